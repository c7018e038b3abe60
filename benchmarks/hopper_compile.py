"""A Triton kernel compiled for Hopper (sm_90) on a host without a GPU, and what it became.

Triton's bundled ``ptxas`` and ``cuobjdump`` turn the kernel into SASS here; nothing
runs. The report gives the resources that bound how many programs an SM holds at once
(registers, shared memory, spills to local memory) and the count of each SASS opcode
in the kernel's text: static counts (a loop body once per copy the compiler made of
it), which say which instructions a launch uses and roughly in what proportion, not
how often they run.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from collections.abc import Callable, Mapping

import attrs
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
#: an H100 / H200 SM: 64K 32-bit registers, 228 KiB of shared memory (1 KiB of it kept
#: per resident program), at most 64 warps and 32 programs
SM_REGISTERS = 65536
SM_SHARED = 228 * 1024
SHARED_PER_PROGRAM = 1024
SM_WARPS = 64
SM_PROGRAMS = 32
#: registers are given to a warp in units of 256
REGISTER_UNIT = 256
#: ``/*0120*/  @!P0 LDS.U8 R3, [R2+0x10] ;``: the opcode after the optional predicate
SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Z0-9_.]*)")


@attrs.frozen
class CompileReport:
    """One compiled kernel: its resources and its SASS opcodes' static counts."""

    shared: int  #: bytes of shared memory a program takes
    registers: int  #: per thread
    spilled: int  #: bytes of local memory per thread (register spills)
    num_warps: int
    opcodes: Mapping[str, int]  #: full opcode (with modifiers) -> count in the text

    def count(self, prefix: str) -> int:
        """Instructions whose opcode starts with ``prefix`` (``"HMMA"``, ``"LDS.U8"``)."""
        return sum(n for op, n in self.opcodes.items() if op.startswith(prefix))

    @property
    def programs_per_sm(self) -> int:
        """Programs one SM holds at once: the least its registers, shared memory, warp
        and program limits allow."""
        per_warp = -(-self.registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
        by_registers = SM_REGISTERS // (per_warp * self.num_warps)
        by_shared = SM_SHARED // (self.shared + SHARED_PER_PROGRAM)
        return min(by_registers, by_shared, SM_WARPS // self.num_warps, SM_PROGRAMS)


def compile_sm90(fn: Callable, signature: dict[str, str], constants: dict[str, object], *,
                 num_warps: int, num_stages: int) -> CompileReport:
    """Compile the ``@triton.jit`` function ``fn`` for sm_90: ``signature`` maps each
    runtime argument to its Triton type (``"*bf16"``, ``"i32"``), ``constants`` each
    ``tl.constexpr`` to its value (a name in both is taken as a constant). Pointers,
    strides and ``block_size`` are marked 16-aligned, as a real launch's are."""
    signature = {**signature, **{name: "constexpr" for name in constants}}
    aligned = [["tt.divisibility", 16]]
    attributes = {
        (fn.arg_names.index(name),): aligned
        for name in fn.arg_names
        if name.endswith("_ptr") or name.startswith("stride") or name == "block_size"
    }
    kernel = triton.compile(
        ASTSource(fn, signature, constants, attributes), target=HOPPER,
        options=dict(num_warps=num_warps, num_stages=num_stages),
    )  # fmt: skip
    tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        usage, sass = (subprocess.run([os.path.join(tools, "cuobjdump"), flag, cubin.name],
                                      capture_output=True, text=True, check=True).stdout
                       for flag in ("--dump-resource-usage", "-sass"))  # fmt: skip
    registers = re.search(r"REG:(\d+)", usage)
    local = re.search(r"LOCAL:(\d+)", usage)
    opcodes = collections.Counter(m.group(1) for line in sass.splitlines()
                                  if (m := SASS_LINE.match(line)))  # fmt: skip
    return CompileReport(
        shared=kernel.metadata.shared,
        registers=int(registers.group(1)) if registers else 0,
        spilled=int(local.group(1)) if local else 0,
        num_warps=num_warps,
        opcodes=dict(opcodes),
    )
