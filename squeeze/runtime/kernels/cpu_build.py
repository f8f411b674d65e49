"""Build and load the native CPU LUT kernels (cpu_lut.cpp), once per machine.

The source is plain C++ on raw pointers with no torch headers: any g++ builds it in about two seconds, and
the library does not depend on the torch version. It is compiled on first use into a per-machine cache
(``$SQUEEZE_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/squeeze/kernels``, else ``~/.cache/squeeze/kernels``),
under a name that hashes the source, the compiler and its flags, so an edited source or another compiler
builds anew. The build writes a temporary file and renames it into place (concurrent first uses are safe).

Without a working compiler, :func:`cpu_kernels` warns once (:class:`KernelWarning`, one line) and returns
None; SqueezeLinear then runs the dense reference path. ``$CXX`` names the compiler (default g++, then c++).
``$SQUEEZE_CPU_ISA`` (avx512, avx2 or scalar) caps the instruction set the kernels use (tests run every path).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

#: Instruction sets of the kernels, best first, with the library's numbering (cpu_lut.cpp's SQ_* enum).
ISAS: dict[str, int] = {"avx512": 2, "avx2": 1, "scalar": 0}
SOURCE = Path(__file__).with_name("cpu_lut.cpp")
#: Every source of the library: the float32 LUT kernels and the W4A8 (int8) kernel, compiled together.
SOURCES = (SOURCE, Path(__file__).with_name("cpu_w8.cpp"))
#: Headers the sources include (hashed with them: an edited header builds anew).
HEADERS = (Path(__file__).with_name("cpu_codes.h"),)
#: -fopenmp: threads over output rows; the library then needs libgomp.so.1, the runtime torch itself loads.
#: -ffp-contract=off: the 8-bit LUT's level * scale + zero rounds twice, as in torch (no fused multiply-add).
CXX_FLAGS = (
    "-O3",
    "-std=c++17",
    "-shared",
    "-fPIC",
    "-fopenmp",
    "-fno-math-errno",
    "-ffp-contract=off",
    "-Wno-maybe-uninitialized",
)
BUILD_TIMEOUT_S = 300


class KernelWarning(RuntimeWarning):
    """The native CPU kernels are unavailable; squeeze runs the dense reference path instead."""


class SqWeight(ctypes.Structure):
    """cpu_lut.cpp's ``sq_weight``: one weight's pointers and sizes (the tensors stay owned by Python)."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("lut", ctypes.c_void_p),
        ("lut_scale", ctypes.c_void_p),
        ("lut_zero", ctypes.c_void_p),
        ("rowptr", ctypes.c_void_p),
        ("pcols", ctypes.c_void_p),
        ("resid", ctypes.c_void_p),
        ("vals", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("bits", ctypes.c_int32),
        ("lut_kind", ctypes.c_int32),
    ]


class SqW8(ctypes.Structure):
    """cpu_w8.cpp's ``sq_w8``: a LUT weight in the W4A8 kernel's form (int8 LUT levels, per-row scales)."""

    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("levels", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("rowptr", ctypes.c_void_p),
        ("cols", ctypes.c_void_p),
        ("resid", ctypes.c_void_p),
        ("rows", ctypes.c_int64),
        ("n", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
        ("bits", ctypes.c_int32),
    ]


class PreparedWeight:
    """Base of the kernels' prepared forms (``cpu_lut.CpuPreparedLut``, ``cpu_w8.W8Prepared``): frozen
    dataclasses whose ``weight`` is the ctypes structure every kernel call receives by reference."""

    weight: ctypes.Structure

    @property
    def weight_ref(self) -> Any:
        """``byref(weight)``, made once and kept: the argument every kernel call passes."""
        ref = self.__dict__.get("_ref")
        if ref is None:
            ref = ctypes.byref(self.weight)
            object.__setattr__(self, "_ref", ref)  # the subclasses are frozen dataclasses
        return ref


_Library = TypeVar("_Library", bound="NativeLibrary")


@dataclass(frozen=True)
class NativeLibrary:
    """A loaded native library (built by :func:`build_library`) and the instruction set it runs here: the base
    of the LUT kernels (:class:`CpuKernels`) and the attention kernel (``cpu_attention.AttentionKernels``)."""

    #: what a message calls the library's code
    what: ClassVar[str] = "kernels"

    lib: ctypes.CDLL
    isa: str
    path: Path

    @property
    def isa_code(self) -> int:
        return ISAS[self.isa]

    def with_isa(self: _Library, isa: str) -> _Library:
        """The same library running ``isa`` (ValueError when this CPU lacks it)."""
        if not self.supports(isa):
            raise ValueError(f"this CPU does not run the {isa!r} {self.what} (it runs {self.isa!r})")
        return dataclasses.replace(self, isa=isa)

    def supports(self, isa: str) -> bool:
        """True when this CPU runs ``isa``."""
        return isa in ISAS and bool(self.lib.sq_isa_supported(ISAS[isa]))


@dataclass(frozen=True)
class CpuKernels(NativeLibrary):
    """The loaded LUT kernels (cpu_lut.cpp, cpu_w8.cpp) and the instruction set they run here."""


def cache_dir() -> Path:
    """Where built kernels are kept (see the module docstring)."""
    explicit = os.environ.get("SQUEEZE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "squeeze" / "kernels"


def find_compiler() -> str | None:
    """Path of the C++ compiler: ``$CXX`` if set (None when it is not found), else g++ or c++ on PATH."""
    explicit = os.environ.get("CXX")
    if explicit:
        return shutil.which(explicit)
    return shutil.which("g++") or shutil.which("c++")


_lock = threading.Lock()


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The native kernels, built on first use; None (after one KernelWarning) when they cannot be built/loaded."""
    with _lock:
        try:
            path = build_library()
            lib = _load(path)
        except KernelBuildError as exc:
            warnings.warn(f"squeeze: native CPU kernels unavailable ({exc}); using the dense path", KernelWarning, 2)
            return None
        return CpuKernels(lib=lib, isa=best_isa(lib), path=path)


class KernelBuildError(Exception):
    """Internal: why the kernels could not be built or loaded (turned into one KernelWarning)."""


def build_library(sources: tuple[Path, ...] = SOURCES, stem: str = "squeeze_cpu_lut") -> Path:
    """Compile ``sources`` into one library in the kernel cache, ``{stem}-{hash}.so`` (or find it built already)."""
    compiler = find_compiler()
    if compiler is None:
        raise KernelBuildError(f"no C++ compiler found (looked for {os.environ.get('CXX') or 'g++, c++'})")
    texts = [path.read_bytes() for path in (*sources, *HEADERS)]
    version = _compiler_version(compiler)
    key = hashlib.sha256(b"\0".join([*texts, version.encode(), " ".join(CXX_FLAGS).encode()])).hexdigest()[:16]
    target = cache_dir() / f"{stem}-{key}.so"
    if target.is_file():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as exc:
        raise KernelBuildError(f"cannot write the kernel cache {target.parent}: {exc.strerror}") from exc
    try:
        result = subprocess.run(
            [compiler, *CXX_FLAGS, *(str(path) for path in sources), "-o", tmp],
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if result.returncode != 0:
            first = next((ln for ln in result.stderr.splitlines() if "error" in ln), result.stderr.strip()[:200])
            raise KernelBuildError(f"{Path(compiler).name} failed: {first}")
        os.replace(tmp, target)  # atomic: a concurrent loader sees the whole library or none
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{Path(compiler).name} could not run: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _compiler_version(compiler: str) -> str:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{compiler} --version failed: {exc}") from exc
    return compiler + "\n" + out.stdout


def _load(path: Path) -> ctypes.CDLL:
    import torch  # noqa: F401 - torch first: its libgomp is the OpenMP runtime the library then shares

    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        raise KernelBuildError(f"cannot load {path.name}: {exc}") from exc
    weight, f32, i64, i32 = ctypes.POINTER(SqWeight), ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.sq_isa_supported.argtypes, lib.sq_isa_supported.restype = [ctypes.c_int], ctypes.c_int
    lib.sq_permute_x.argtypes, lib.sq_permute_x.restype = [f32, f32, i64, i64, i32], None
    lib.sq_lut_matmul.argtypes, lib.sq_lut_matmul.restype = [weight, f32, i64, f32, f32, i32, i32, i32], None
    lib.sq_bf16_supported.argtypes, lib.sq_bf16_supported.restype = [], ctypes.c_int
    lib.sq_dequant_rows.argtypes, lib.sq_dequant_rows.restype = [weight, i64, i64, f32, i32, i32], None
    lib.sq_dense_linear.argtypes = [f32, i64, i64, f32, i64, f32, f32, i32, i32]
    lib.sq_dense_linear.restype = None
    lib.sq_dense_linear_typed.argtypes = [f32, i32, i64, i64, f32, i64, f32, f32, i32, i32]
    lib.sq_dense_linear_typed.restype = None
    lib.sq_w8_linear.argtypes = [ctypes.POINTER(SqW8), f32, i64, f32, f32, i32, i32]
    lib.sq_w8_linear.restype = None
    return lib


def best_isa(lib: ctypes.CDLL) -> str:
    """The best instruction set ``lib`` (a kernels library with ``sq_isa_supported``) runs on this CPU, capped
    by ``$SQUEEZE_CPU_ISA`` (module docstring; an unknown value warns once and is ignored)."""
    cap = os.environ.get("SQUEEZE_CPU_ISA", "").strip().lower()
    names = list(ISAS)
    if cap in ISAS:
        names = names[names.index(cap) :]
    elif cap:
        warnings.warn(
            f"squeeze: SQUEEZE_CPU_ISA={cap!r} is not one of {', '.join(ISAS)}; ignoring it", KernelWarning, 3
        )
    return next(name for name in names if lib.sq_isa_supported(ISAS[name]))


__all__ = [
    "CpuKernels",
    "NativeLibrary",
    "KernelWarning",
    "KernelBuildError",
    "SqWeight",
    "SqW8",
    "PreparedWeight",
    "cpu_kernels",
    "build_library",
    "best_isa",
    "cache_dir",
    "find_compiler",
    "ISAS",
    "HEADERS",
]
