"""Hand-written kernel skeletons with holes; installed as ``flexjit.templates``."""
