"""FP8 (e4m3) operands of the sm90 forward: how P's registers meet Vᵀ, and the query's sign.

The FP8 forward runs both GEMMs on e4m3 wgmma, which takes both operands K-major. Q and K are
K-major as stored. For O += P·V the reduction runs over keys, so V is read as Vᵀ (Dv × keys,
keys contiguous): the host writes it once per call (``KEY_SLOT``, ``backends.cute.sm90``).

P comes from registers as the A operand. Per thread and row, a k32 block of an 8-bit A fragment
holds keys 4t..4t+3 and 16+4t..19+4t (t = lane % 4), while the QK GEMM's fp32 accumulator holds
keys 2t, 2t+1, 8+2t, 9+2t, 16+2t, 17+2t, 24+2t, 25+2t of the same row (PTX ISA, wgmma register
fragments). Instead of moving bytes between threads, the host permutes V's keys within every
32-key block: key j of a block sits at slot ``KEY_SLOT[j]`` of Vᵀ. The accumulator's registers
then convert in place into the A fragment (``acc_as_fp8_operand_a``): the key a P value stands
for and the Vᵀ column it meets are the same. Only the PV GEMM sees the permutation; the scores,
the mods and the masks keep the keys' true positions.

A negative descale product flips the sign of every score. The kernel's softmax takes its row max
on the raw products (the scale folded into exp2's multiplier), so instead it flips the sign bit
of every byte of its Q tile in smem once (``negate_fp8``) and runs on the magnitude.
"""
import cutlass
import cutlass.cute as cute
from cutlass import Int32, Uint32

# KEY_SLOT[j]: the slot of key j (of each 32-key block) in the permuted Vᵀ. Key j = 8g + 2t + c
# (g: the accumulator's 8-column group, t: the thread in its quad, c: the column in the pair)
# is accumulator register (c, g) of thread t; the A fragment's register of the same index holds
# slot 16·(g // 2) + 4t + 2·(g % 2) + c.
KEY_SLOT = tuple(16 * (j // 16) + 4 * ((j % 8) // 2) + 2 * ((j // 8) % 2) + j % 2 for j in range(32))


def acc_as_fp8_operand_a(acc: cute.Tensor, frag: cute.Tensor):
    """(source, destination): the fp32 S accumulator ((2, 2, V), 1, 1) and the e4m3 A fragment
    ((4, 2, 2), 1, V/4) as rank-1 views in the same order, so that
    ``dst.store(src.load().to(Float8E4M3FN))`` converts P in place. Per k32 block the A
    fragment's 4 bytes of a row take the accumulator's columns (pair c of group 2h) then (pair c
    of group 2h + 1); ``KEY_SLOT`` permutes V to match."""
    dense = cute.make_layout(acc.layout.shape)
    (c2, r2, v), mm, mn = dense.shape
    (sc, sr, sv), _, _ = dense.stride
    assert mm == 1 and mn == 1 and c2 == 2 and r2 == 2 and v % 4 == 0, dense
    blocks = v // 4
    src = cute.make_layout(((2, 2), 2, 2, blocks), stride=((sc, sv), sr, 2 * sv, 4 * sv))
    dst = cute.make_layout(((2, 2), 2, 2, blocks), stride=((1, 2), 4, 8, 16))
    # The fragment's storage is the wgmma's register order: per k32 block, 4 bytes (keys 4t..)
    # of row g, of row g + 8, then keys 16 + 4t.. of each row.
    assert cute.size(frag) == cute.size(dst) and cute.cosize(frag.layout) == cute.size(dst), frag.layout
    return (cute.make_tensor(acc.iterator, cute.composition(acc.layout, src)),
            cute.make_tensor(frag.iterator, dst))


@cute.jit
def negate_fp8(sQ: cute.Tensor, thread: Int32, num_threads: cutlass.Constexpr):
    """Flip the sign bit of every e4m3 byte of the smem tile ``sQ`` (whole 32-bit words, any
    swizzle: every byte flips), ``num_threads`` threads striding over it. The caller fences the
    writes for the async proxy and synchronises the threads before a wgmma reads the tile."""
    words = cute.recast_tensor(cute.make_tensor(sQ.iterator, cute.make_layout(cute.cosize(sQ.layout))),
                               Uint32)
    n = cute.size(words)
    for i in cutlass.range(thread, n, num_threads, unroll=1):
        words[i] = words[i] ^ Uint32(0x80808080)
