"""``overflow-fast info`` / ``python -m overflow_fast info`` / ``overflow_fast.info()``: what runs
here. One fact a line: versions, the C++ CPU kernel (its instruction set and where it is built or
cached, or why it is unavailable; the cache folder in use, and why a configured one is not), the
default backend of each device type, the CUDA devices seen and the environment variables that
change any of it.

Asking builds the C++ kernel if this environment has none yet (as the first use would).
"""

import os
import platform
import sys

# Variables other than OVERFLOW_FAST_* that change what is built or chosen.
RELATED_ENV = ("ATEN_CPU_CAPABILITY", "TORCH_EXTENSIONS_DIR", "CXX", "MAX_JOBS", "TRITON_INTERPRET")


def _triton():
    try:
        import triton
    except Exception as error:
        reason = "not installed" if isinstance(error, ModuleNotFoundError) else f"{type(error).__name__}: {error}"
        return f"unavailable ({reason})"
    return getattr(triton, "__version__", "unknown version")


def _cuda_devices():
    import torch

    if not torch.cuda.is_available():
        return []
    devices = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        devices.append(f"{index}: {props.name} (sm_{props.major}{props.minor}, "
                       f"{props.total_memory / 2**30:.0f} GiB)")
    return devices


def _default_backends(status):
    """{device type: the backend a plain tensor there gets with backend=None, and why}."""
    from .stats import dispatch

    env = os.environ.get(dispatch.ENV_VAR) or None
    chosen = {}
    for device, preferred in list(dispatch._PREFERRED.items()) + [("other", "torch")]:
        if env in dispatch.BACKEND_NAMES and status.get(env) is None:
            chosen[device] = f"{env} ({dispatch.ENV_VAR})"
        elif status.get(preferred) is None:
            chosen[device] = preferred
        else:
            why = "the C++ kernel is unavailable" if preferred == "cpu" else f"{preferred} unavailable: {status[preferred]}"
            chosen[device] = f"torch ({why})"
    return chosen


def _per_hook_paths():
    """{device: "<path>; self-check <result>; launch <how>"} of the triton backend's list read, which
    reads each hook's GPU tensors: every CUDA device is set up (and self-checked) now, as its first
    use would, but no probe of its direct launch is started here (the first read starts it), and a
    device set up only for this report is forgotten again; without one, how the launch would be
    made."""
    import torch

    from .stats import triton_backend, triton_devices, triton_list

    if triton_backend.unavailable_reason() is not None:
        return {"gpu": "none here (the triton backend, which reads each hook's GPU tensors, is unavailable: "
                       f"{triton_backend.unavailable_reason()})"}
    report, made = {}, []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            try:
                if triton_devices.lookup(device) is None:
                    triton_list.check_device(device, probe=False)
                    made.append(device)
            except Exception as error:  # noqa: BLE001 - info reports, it never fails
                report[f"cuda:{index}"] = f"cannot be set up ({type(error).__name__}: {error})"
    report.update({device: f"{path}; self-check {check}; launch {launch}"
                   for device, (path, check, launch) in triton_backend.device_report().items()})
    for device in made:
        triton_devices.forget(device)
    if not report:
        report["none used yet"] = f"{triton_backend.LIST} on first use; launch {triton_backend.launch_path()}"
    return report


def _direct_launch():
    """When the list kernel's direct launch is probed, what that costs, and where verdicts are kept."""
    try:
        from .stats import triton_backend, triton_verdicts

        if triton_backend.unavailable_reason() is not None:
            return "none (no triton backend)"
        return triton_verdicts.describe()
    except Exception as error:  # noqa: BLE001 - info reports, it never fails
        return f"cannot be said ({type(error).__name__}: {error})"


def info():
    """What runs here, as a dict: ``overflow_fast``, ``python``, ``torch``, ``triton``,
    ``cpu_kernel`` (``"avx512"``, ``"avx2"``, ``"baseline"`` or ``"unavailable (<reason>)"``),
    ``cpu_kernel_file``, ``cpu_kernel_origin``, ``cpu_kernel_cache``, ``log_reader`` (what
    reads logs for ``report`` and ``diff``), ``default_backend``
    ({device type: backend}), ``cuda_devices`` (list), ``per_hook_read`` ({device: the triton
    backend's per-hook path there, its self-check and how it launches}), ``direct_launch`` (when
    the direct launch of that path is probed and what the probe costs) and ``environment``
    ({name: value})."""
    import torch

    from ._version import __version__
    from .report import engine
    from .stats import cpu_backend, dispatch

    reason = cpu_backend.unavailable_reason()
    details = cpu_backend.details()
    if reason is None:
        capability = cpu_backend._C.capability()
        kernel = {"default": "baseline"}.get(capability, capability)
    else:
        kernel = f"unavailable ({reason})"
    origin = details.get("origin")
    if origin == "prebuilt":
        where = "prebuilt, installed with the package"
    elif origin == "cache":
        seconds = details.get("seconds")
        took = f"{seconds:.0f} s" if isinstance(seconds, (int, float)) else None
        if details.get("built_now"):
            where = "built just now" + (f" in {took}" if took else "")
        else:
            where = "cached" + (f"; its build took {took}" if took else "")
    else:
        where = None
    cache = details.get("cache_root")
    if details.get("cache_rejected"):
        cache = f"{cache} (the configured one is not private: {details['cache_rejected']})"
    status = dispatch.backend_status()
    environment = {name: value for name, value in sorted(os.environ.items())
                   if name.startswith("OVERFLOW_FAST_") or name in RELATED_ENV}
    return {
        "overflow_fast": f"{__version__} ({os.path.dirname(os.path.abspath(__file__))})",
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": f"{torch.__version__} (C++ ABI {'cxx11' if torch._C._GLIBCXX_USE_CXX11_ABI else 'pre-cxx11'})",
        "triton": _triton(),
        "cpu_kernel": kernel,
        "cpu_kernel_file": details.get("path"),
        "cpu_kernel_origin": where,
        "cpu_kernel_cache": cache,
        "log_reader": engine.describe(),
        "default_backend": _default_backends(status),
        "cuda_devices": _cuda_devices(),
        "per_hook_read": _per_hook_paths(),
        "direct_launch": _direct_launch(),
        "environment": environment,
    }


def lines(facts):
    """The report, one fact a line."""
    out = [f"overflow_fast: {facts['overflow_fast']}", f"python: {facts['python']}",
           f"torch: {facts['torch']}", f"triton: {facts['triton']}", f"cpu kernel: {facts['cpu_kernel']}"]
    if facts["cpu_kernel_file"]:
        out.append(f"cpu kernel file: {facts['cpu_kernel_file']} ({facts['cpu_kernel_origin']})")
    out.append(f"cpu kernel cache: {facts['cpu_kernel_cache']}")
    out.append(f"log reader: {facts['log_reader']}")
    for device, backend in facts["default_backend"].items():
        out.append(f"default backend ({device}): {backend}")
    out.append(f"cuda devices: {len(facts['cuda_devices']) or 'none'}")
    out += [f"cuda device {device}" for device in facts["cuda_devices"]]
    out += [f"per-hook read ({device}): {path}" for device, path in facts["per_hook_read"].items()]
    out.append(f"direct launch: {facts['direct_launch']}")
    if not any(name.startswith("OVERFLOW_FAST_") for name in facts["environment"]):
        out.append("environment: no OVERFLOW_FAST_* variable set")
    out += [f"environment: {name}={value}" for name, value in facts["environment"].items()]
    return out


def main(argv=None):
    print("\n".join(lines(info())))
    return 0
