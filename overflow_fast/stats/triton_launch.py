"""The list kernel's launch, with the extension: the C++ ``Launcher`` of a device, its ordinary
launches through Triton, the registration of compiled variants for the direct launch, and how
the kernel is launched now (``launch_path``)."""

import os
import sys
import weakref

import torch

from . import triton_common, triton_kernels
from .triton_common import (_ALIGNED_BIT, _FORMAT_WORD, _PLAIN_TYPES, MAX_FORMATS, NUM_WARPS, _extension,
                            _REGISTER_CAP, triton)

# The launch itself, with the extension: the C++ ``Launcher`` of the device (csrc/table.cpp) checks
# and packs the tensors in one loop (the table kernels' loop) and launches. A variant's first launch
# goes through Triton's ordinary call (``_ordinary_launch``: it compiles the variant); its compiled
# kernel is then registered (``_register``) if its metadata is exactly what the direct launch passes
# (no scratch memory, one CTA, no cooperative or PDL launch, no instrumentation, 28 eight-byte
# parameters), and later launches of it call ``cuLaunchKernel`` on its CUfunction from C++, as
# AOTInductor's launchers do. Triton's launch hooks (a profiler's) decide per launch: while one is
# set, launches go through Triton so that it sees them. Without the extension, every launch is
# Triton's ordinary call. ``launch_path`` says which, with the same predicate.

SLOT_VARIANTS = (1, 2, 4, 8)
MAX_SLOTS = SLOT_VARIANTS[-1]
MAX_READ_LAUNCHES = 4
STREAM_GROUPS = 64  # accumulator groups per device: the streams that can run the list kernel
_IDENTITY_ROW = (2**63 - 1, -(2**63), 0, 0, 0, 0, 0, 0)  # keys at the ends of int64, counts and counter 0

DIRECT = "direct (cuLaunchKernel from C++)"
# the list kernel's parameters, in order: what the C++ launcher packs (csrc/launch.h)
_RUNTIME_ARGS = ("Out", "Accumulators", *(f"{c}{i}" for i in range(MAX_SLOTS) for c in "anw"))
_CONSTEXPRS = ("K", "FORMATS", "ANY_UNALIGNED", "BLOCK_SIZE", "BLOCKS_PER_CHUNK")
_SCRATCH_POINTERS = 2  # Triton's global and profile scratch, after the kernel's own parameters


def _runtime_knobs():
    """(triton.knobs.runtime, None) where launch hooks can be read, else (None, why not)."""
    try:
        from triton import knobs
        runtime = knobs.runtime
        knobs.HookChain  # noqa: B018 - an empty chain is told from a hook by this type
    except Exception as error:  # an older Triton
        return None, f"this Triton ({triton.__version__}) has no triton.knobs.runtime and HookChain ({error})"
    if not (hasattr(runtime, "launch_enter_hook") and hasattr(runtime, "launch_exit_hook")):
        return None, f"this Triton ({triton.__version__}) has no knobs.runtime.launch_enter_hook/launch_exit_hook"
    return runtime, None


_HOOK_REASONS = {"launch_enter_hook": "a Triton launch hook is set (triton.knobs.runtime.launch_enter_hook)",
                 "launch_exit_hook": "a Triton launch hook is set (triton.knobs.runtime.launch_exit_hook)"}
PRE_RUN_REASON = "the list kernel has a pre-run hook (JITFunction.add_pre_run_hook)"


def launch_hooks(runtime=None, kernel=None):
    """Triton's launch hooks (``runtime``: default triton.knobs.runtime; ``kernel``: default the list
    kernel) as the plain data the C++ launcher reads at each launch, without looking anything up
    by name there: (a reason fixed now, or None; ((list, what a hook in it means), ...): the lists
    hooks are added to, read by their size; the dict holding the chains, whose size changes when
    one is replaced rather than added to, or None). None where there are no hooks to read.

    A chain (Triton >= 3.4: never None, empty when no hook is set) is watched through its list;
    a hook set as the attribute itself (earlier Tritons' way, still accepted) fixes the reason."""
    if runtime is None:
        runtime, _ = _runtime_knobs()
        if runtime is None:
            return None
    if kernel is None:
        kernel = triton_kernels._list_kernel
    chain_type = getattr(sys.modules.get("triton.knobs"), "HookChain", None)
    fixed, watched = None, []
    for name, reason in _HOOK_REASONS.items():
        hook = getattr(runtime, name, _MISSING)
        if hook is _MISSING:
            fixed = fixed or "triton.knobs.runtime has no launch hooks to read"
        elif chain_type is not None and type(hook) is chain_type and type(getattr(hook, "calls", None)) is list:
            watched.append((hook.calls, reason))
        elif hook is not None:
            fixed = fixed or reason
    hooks = getattr(kernel, "pre_run_hooks", None)
    if type(hooks) is list:
        watched.append((hooks, PRE_RUN_REASON))
    holder = getattr(runtime, "__dict__", None)
    return fixed, tuple(watched), holder if type(holder) is dict else None


_MISSING = object()


def hooks_reason():
    """Why a launch of the list kernel must go through Triton's own launcher now, or None: the C++
    launcher's predicate on ``launch_hooks()``."""
    return _extension().launch_hooks_reason(launch_hooks())


def _launcher_driver(device):
    """The C++ launcher's driver for ``device`` and, where it cannot launch directly, why:
    ("cuda", None), or ("ordinary", why) (every launch through Triton)."""
    if _extension() is None:
        return None, "the C++ extension is unavailable"
    if triton_common._INTERPRET:
        return "ordinary", "the interpreter runs the kernels (TRITON_INTERPRET=1)"
    if device.type != "cuda":
        return "ordinary", f"no direct launch on {device.type}"
    if os.environ.get("OVERFLOW_FAST_DIRECT_LAUNCH", "1") == "0":
        return "ordinary", "OVERFLOW_FAST_DIRECT_LAUNCH=0"
    _, reason = _runtime_knobs()
    if reason is not None:
        return "ordinary", reason
    return "cuda", None


# Drivers whose direct launch waits for the device's verdict (triton_verdicts): a direct launch
# with a wrong argument would end the process's CUDA context.
VERDICT_DRIVERS = ("cuda",)


def _new_launcher(state, pool, block_size, blocks_per_chunk):
    """(the C++ launcher of ``state``'s device for a launch shape, or None; why it cannot launch
    directly, or None)."""
    driver, reason = _launcher_driver(state.device)
    if driver is None:
        return None, reason
    shape = (block_size, blocks_per_chunk)
    # weak: the launcher (C++, which Python's collector cannot see into) holds this callback, and
    # the state holds the launcher
    owner = weakref.ref(state)

    def ordinary(grid, args, slots, formats, any_unaligned):
        known = owner()
        if known is None:  # forget_devices() dropped it: a core that still holds this launcher disables it
            raise RuntimeError("the list read's state of this device was forgotten")
        _ordinary_launch(known, known.launcher_for(*shape), grid, args, slots, formats, any_unaligned, *shape)

    def make(driver):
        return _extension().Launcher(driver, state.device, _PLAIN_TYPES, _FORMAT_WORD, _ALIGNED_BIT,
                                     block_size * blocks_per_chunk, MAX_READ_LAUNCHES, MAX_FORMATS, pool,
                                     STREAM_GROUPS, launch_hooks(), launch_hooks, driver not in VERDICT_DRIVERS,
                                     ordinary)

    try:
        launcher = make(driver)
    except Exception as error:  # noqa: BLE001 - e.g. no libcuda.so.1: Triton's own launches
        driver, reason = "ordinary", f"{type(error).__name__}: {error}"
        launcher = make(driver)
    return launcher, reason


def _ordinary_launch(state, launcher, grid, args, slots, formats, any_unaligned, block_size, blocks_per_chunk):
    """A launch the C++ launcher could not make directly, through Triton (``JITFunction.run``,
    which compiles the variant on its first launch); the compiled variant is then registered for
    direct launches where its metadata allows."""
    kernel = triton_kernels._list_kernel[(grid,)](*args, K=slots, FORMATS=formats, ANY_UNALIGNED=any_unaligned,
                                   BLOCK_SIZE=block_size, BLOCKS_PER_CHUNK=blocks_per_chunk, num_warps=NUM_WARPS,
                                   **_REGISTER_CAP)
    key = (slots, formats, any_unaligned, block_size, blocks_per_chunk)
    if launcher.driver == "cuda" and key not in state.compiled and key not in state.refused:
        _register(state, launcher, key, kernel)


def _register(state, launcher, key, kernel):
    """Register a compiled variant (``key``: K, FORMATS, ANY_UNALIGNED, then the launch shape) with
    the launcher, or note why its launch stays Triton's."""
    reason = direct_mismatch(kernel)
    if reason is None:
        metadata = kernel.metadata
        reason = launcher.add_variant(*key[:3], kernel.function, 32 * metadata.num_warps, metadata.shared) or None
    if reason is None:
        state.compiled[key] = kernel  # Triton unloads the CUfunction with its CompiledKernel
    else:
        state.refused[key] = reason


def direct_mismatch(kernel):
    """None when the compiled list kernel ``kernel`` (loaded on its device) takes exactly what the
    direct launch passes, else what differs (``metadata_mismatch``)."""
    if not isinstance(getattr(kernel, "function", None), int):
        return "no CUfunction: not a compiled CUDA kernel"
    return metadata_mismatch(kernel)


def metadata_mismatch(kernel):
    """None when the compiled list kernel's metadata and PTX say that it takes exactly what the
    direct launch passes (csrc/table.cpp, Launcher::launch_direct: grid (programs, 1, 1), 32 *
    num_warps threads, its dynamic shared memory, no launch attribute; the 26 int64 values, then
    the two scratch pointers, null), else what differs. Read in Triton 3.6's and 3.9's CUDA
    launchers (driver.py, driver.c): they add scratch memory, clusters (num_ctas), cooperative and
    PDL attributes and instrumentation arguments only where the metadata asks for them."""
    metadata = getattr(kernel, "metadata", None)
    if metadata is None:
        return "no metadata: not a compiled kernel"
    signature = getattr(getattr(kernel, "src", None), "signature", None)
    expected = {**{name: "i64" for name in _RUNTIME_ARGS}, **{name: "constexpr" for name in _CONSTEXPRS}}
    if signature != expected:
        return f"its signature {signature} is not the list kernel's"
    for name, wanted in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False),
                         ("global_scratch_size", 0), ("profile_scratch_size", 0), ("instrumentation_mode", "")):
        value = getattr(metadata, name, wanted)  # absent or None: this Triton has no such feature
        if value not in (wanted, None):
            return f"its metadata asks for {name}={value!r}, which the direct launch does not pass"
    if getattr(metadata, "tensordesc_meta", None):
        return "it takes tensor descriptors"
    packed = tuple(getattr(kernel, "packed_metadata", ()))
    if packed != (metadata.num_warps, metadata.num_ctas, metadata.shared):
        return f"its launcher metadata {packed} is not (num_warps, num_ctas, shared)"
    params = ptx_parameters(getattr(kernel, "asm", {}).get("ptx"), getattr(metadata, "name", None))
    want = len(_RUNTIME_ARGS) + _SCRATCH_POINTERS
    if params is None:
        return "its PTX entry cannot be read"
    if len(params) != want or any(not p.startswith(".u64") and not p.startswith(".b64") for p in params):
        return f"its PTX entry takes {len(params)} parameters ({', '.join(sorted(set(params)))}), not {want} of 8 bytes"
    return None


def ptx_parameters(ptx, name):
    """The types of the parameters of kernel ``name``'s ``.entry`` in ``ptx`` (``.u64``, ``.u64 .ptr
    .global .align 1``, ...), or None when there is no such entry."""
    if not isinstance(ptx, str) or not name:
        return None
    import re

    match = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((.*?)\)", ptx, re.S)
    if match is None:
        return None
    params = []
    for line in match.group(1).split(","):
        words = line.split()
        if not words:
            continue
        if words[0] != ".param":
            return None
        params.append(" ".join(words[1:-1]))  # the type and qualifiers, without the name
    return params


def launch_path(state=None):
    """How the list kernel is launched on ``state``'s device now (default: a device not set up
    yet): ``DIRECT``, or "ordinary (why)" for Triton's own launch. The launch hooks are read again
    now, for the C++ launcher's own predicate."""
    if state is not None and state.launcher is not None:
        launcher = state.launcher
        launcher.refresh_hooks()
        if launcher.disabled is not None:
            return f"none ({launcher.disabled}; the table kernels read)"
        reason = state.launch_reason
        if reason is None and not launcher.direct_allowed:
            reason = f"the direct launch {state.probe or 'is not allowed yet'}"
        reason = reason or launcher.hooks_reason()
        if reason is None and state.refused:
            reason = f"{len(state.refused)} variant(s) refused: {next(iter(state.refused.values()))}"
            return f"{DIRECT}, but {reason}"
        return DIRECT if reason is None else f"ordinary ({reason})"
    if triton is None:
        return f"ordinary ({triton_common._IMPORT_ERROR})"
    device = state.device if state is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    driver, reason = _launcher_driver(device)
    if reason is None:
        reason = hooks_reason()
    return f"{DIRECT} once its probe passed" if reason is None else f"ordinary ({reason})"
