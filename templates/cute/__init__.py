"""The CuTeDSL kernel templates: parts every arch shares here, each arch's kernels in its folder."""
