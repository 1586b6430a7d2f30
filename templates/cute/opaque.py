"""Values the compiler cannot follow: a volatile move that keeps ptxas from merging (CSE) or
hoisting what is computed from it, where that merging costs registers or instructions; and a
volatile use that keeps LLVM from sinking what computes its operands."""

import cutlass.cute as cute
from cutlass import Int32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op


@dsl_user_op
def opaque_thread_idx(*, loc=None, ip=None) -> Int32:
    """%tid.x through a volatile asm statement: a value the compiler cannot merge with (or
    hoist above) earlier thread-index arithmetic."""
    value = llvm.inline_asm(T.i32(), [], "mov.u32 $0, %tid.x;", "=r", has_side_effects=True,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(value)


@dsl_user_op
def opaque_i32(x: Int32, *, loc=None, ip=None) -> Int32:
    """``x`` through a volatile asm move: the compiler cannot CSE what is computed from the
    result with what was computed from ``x`` before (nor hoist it above that point)."""
    value = llvm.inline_asm(T.i32(), [Int32(x).ir_value(loc=loc, ip=ip)], "mov.u32 $0, $1;", "=r,r",
                            has_side_effects=True, is_align_stack=False,
                            asm_dialect=llvm.AsmDialect.AD_ATT)
    return Int32(value)


@dsl_user_op
def use_all(t: cute.Tensor, *, loc=None, ip=None) -> None:
    """An empty volatile asm statement that reads every element of ``t`` (32-bit registers):
    what computes them stays before this point, which stays where it is among the other
    volatile operations (waits, barriers)."""
    values = [t[i].ir_value(loc=loc, ip=ip) for i in range(cute.size(t))]
    llvm.inline_asm(None, values, "", ",".join("r" * len(values)), has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)


def opaque_smem(t: cute.Tensor, swizzle) -> cute.Tensor:
    """``t``, a ``swizzle``d smem tile starting on a 1024-byte boundary (a swizzle atom), rebased
    on its address passed through a volatile move: the same tile, the same wgmma descriptors.

    It keeps ptxas from splitting the descriptors' 64-bit adds. From an address the compiler
    can follow (a stage slice ``sQ[None, None, idx]``, or a constant offset from the smem base),
    the DSL forms each k-block's descriptor as a 64-bit add to one whose high word is the
    constant 0x40000040 (stride byte offset and swizzle mode), and ptxas turns each add into
    UIADD3 + UIADD3.X plus UMOVs that re-materialise the high word; from an opaque address it
    builds the tile's descriptor once and adds each k-block's offset with one UIADD3.64 (a
    ULOP3 on the low word where the DSL knows the offset's bits are clear). Call
    it inside the Q-tile loop: rebased once before it, K and V's descriptors are hoisted into
    vector registers (an R2UR per use, and registers the elementwise work needs).

    The rebased pointer claims 16-byte alignment only (true: the tile is 1024-aligned; the
    descriptor's address field is addr >> 4 either way, and the swizzle acts on the address
    bits, not on what the compiler assumes). Claiming 1024 lets the DSL OR the first k-blocks'
    offsets into the low word, each OR needing the high word 0x40000040 re-materialised (UMOV);
    at 16 it adds them (UIADD3.64): CPU SASS hot loop D=128 4 fewer instructions, D=64 0-1
    (32 and 128 give the same code as 1024)."""
    addr = opaque_i32(t.iterator.toint())
    ptr = cute.make_ptr(t.element_type, addr, cute.AddressSpace.smem, assumed_align=16,
                        swizzle_=swizzle)
    return cute.make_tensor(ptr, t.layout)
