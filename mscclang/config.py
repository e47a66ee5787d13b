"""Every environment variable mscclang reads or sets, declared once. Each ``MSCCLANG_*`` one with
its type, default, validation and a one-line description; each of another program (NCCL, CUDA,
torch, a launcher) with what it means here (:func:`externals`). Code reads ``settings.<name>``,
never ``os.environ``; the environment NCCL must run with is :func:`nccl_env`.

Each setting is a descriptor on :class:`Settings`; reading it reads the environment at that
moment (nothing is cached, so a program or a test may change a variable between calls), and a
variable that is unset or blank means the default. A value the setting does not accept raises
an error that names the variable, the value and what is accepted; the error's class is the one
the reading subsystem documents (:class:`~mscclang.errors.LimitError` for limits,
:class:`~mscclang.errors.InvalidCall` for the collective API's settings, ...), by default
:class:`~mscclang.errors.SettingError`. An explicit value given through an API (for instance
``Executor(specialize=...)``) goes through the same rule with ``Settings.<name>.or_env(value)``
(None: the environment's value).

``settings`` reads ``os.environ``; ``Settings(mapping)`` reads another mapping (a launcher's
environment, a test's dict). :func:`describe` lists every setting with its value;
``mscclang env`` prints that table and ``docs/settings.md`` is :func:`settings_markdown`.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Generic, Mapping, Optional, Sequence, TypeVar, Union

from mscclang.errors import InvalidCall, LimitError, RuntimeUnavailable, SettingError, SpecUnsupported, WorkerError
from mscclang.units import BYTE_COUNT_EXAMPLES, format_bytes, parse_bytes

__all__ = ["Settings", "settings", "EnvVar", "EnvSetting", "EnvBool", "EnvInt", "EnvFloat", "EnvBytes", "EnvStr",
           "EnvPath", "EnvChoice", "SettingInfo", "declared", "externals", "describe", "settings_markdown",
           "settings_text", "default_sim_max_memory", "nccl_env", "worker_env", "CUDA_MAX_CONNECTIONS"]

T = TypeVar("T")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
CUDA_MAX_CONNECTIONS = 32   # CUDA uses at most 32 hardware work queues per process, whatever is asked


class EnvVar:
    """One environment variable ``name``, declared on :class:`Settings`, and what it does
    (``doc``, one line). This base class declares a variable of another program (NCCL, CUDA,
    torch, a launcher) that mscclang reads or sets: reading it gives its text as it is (None when
    unset), and the reader applies that program's rule. :class:`EnvSetting` is a ``MSCCLANG_*`` one."""

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.doc = doc
        self.attr = ""

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    def __get__(self, obj: Optional["Settings"], owner: type) -> Any:
        return self if obj is None else obj.environ.get(self.name)

    def __set__(self, obj: "Settings", value: Any) -> None:
        raise AttributeError(f"settings.{self.attr} is read from ${self.name}; set the environment variable")


class EnvSetting(EnvVar, Generic[T]):
    """One ``MSCCLANG_*`` variable ``name``: ``default`` (a value, or a callable giving it, when the
    default depends on the machine) applies when it is unset or blank; ``doc`` says what it does
    in one line; ``default_doc`` replaces the default in tables where the value alone would
    mislead (``no cap``); ``error`` is the exception class a bad value raises; ``check`` names
    (``module:function``, since that code imports this module) the test of the code that reads a
    file or folder the value names, which :meth:`checked` runs."""

    kind = "str"

    def __init__(self, name: str, default: Union[T, Callable[[], T], None], doc: str, *,
                 default_doc: Optional[str] = None, error: type[Exception] = SettingError, check: Optional[str] = None) -> None:
        if not name.startswith("MSCCLANG_"):
            raise ValueError(f"setting {name!r}: every variable is named MSCCLANG_*")
        super().__init__(name, doc)
        self.default = default
        self.default_doc = default_doc
        self.error = error
        self.check = check

    def __get__(self, obj: Optional["Settings"], owner: type) -> Any:
        return self if obj is None else self.parse(obj.environ.get(self.name))

    def or_env(self, value: Any = None) -> Optional[T]:
        """``value`` (given through an API) by this setting's rule, or, when it is None, the
        setting's value in :data:`settings`."""
        return self.__get__(settings, Settings) if value is None else self.parse(value)

    def default_value(self) -> Optional[T]:
        """The default (computed now when it depends on the machine)."""
        return self.default() if callable(self.default) else self.default

    def parse(self, raw: Optional[str]) -> Optional[T]:
        """The setting's value for the text ``raw`` (None or blank: the default); raises
        :attr:`error` naming the variable when the text is not accepted."""
        if raw is None or not str(raw).strip():
            return self.default_value()
        return self.convert(str(raw).strip())

    def checked(self, raw: Optional[str]) -> Optional[T]:
        """:meth:`parse`, then, for a set value, the ``check`` of the code that reads it (a file
        that cannot be read, a folder with no plan): what it refuses raises :attr:`error` naming
        the variable and the value, as :meth:`parse` does."""
        value = self.parse(raw)
        if self.check and str(raw or "").strip():
            module, func = self.check.split(":")
            try:
                getattr(importlib.import_module(module), func)(value)
            except Exception as e:  # the reader's refusal, of its own class; named as this variable's
                raise e if str(e).startswith(f"{self.name}=") else self.fail(str(raw).strip(), str(e)) from None
        return value

    def convert(self, text: str) -> T:
        """The value of a non-blank, stripped text (each kind overrides it)."""
        return text  # type: ignore[return-value]

    def _parsed(self, text: str, parse: Callable[[str], Any], why: str) -> Any:
        """``parse(text)``; its ValueError becomes :meth:`fail` with ``why``."""
        try:
            return parse(text)
        except ValueError:
            raise self.fail(text, why) from None

    def fail(self, text: object, why: str) -> Exception:
        """The exception for a refused value (the caller raises it)."""
        return self.error(f"{self.name}={text!r}: {why}")

    def show(self, value: Any) -> str:
        """``value`` as the settings table prints it."""
        return "(unset)" if value is None else str(value)


class EnvStr(EnvSetting[str]):
    """Any text (stripped)."""


class EnvPath(EnvSetting[str]):
    """A file or folder path (the text as it is, stripped; relative to the working directory).
    With ``folder``, a path that is not a folder is refused, a missing one too unless ``made``
    (a folder mscclang makes when it writes there)."""

    kind = "path"

    def __init__(self, name: str, default: Optional[str], doc: str, *, folder: bool = False, made: bool = False, **kw: Any) -> None:
        super().__init__(name, default, doc, **kw)
        self.folder, self.made = folder, made

    def convert(self, text: str) -> str:
        if self.folder and not Path(text).is_dir() and (Path(text).exists() or not self.made):
            raise self.fail(text, "not a folder" if Path(text).exists() else "no such folder")
        return text


class EnvBool(EnvSetting[bool]):
    """A switch: ``1``, ``true``, ``yes``, ``on`` or ``0``, ``false``, ``no``, ``off``
    (case-insensitive)."""

    kind = "bool"

    def convert(self, text: str) -> bool:
        t = text.lower()
        if t in _TRUE:
            return True
        if t in _FALSE:
            return False
        raise self.fail(text, f"use {', '.join(_TRUE)} or {', '.join(_FALSE)}")

    def show(self, value: Any) -> str:
        return "on" if value else "off"


class EnvInt(EnvSetting[int]):
    """An integer, at least ``minimum`` when that is given; ``what`` names the kind of number in
    the message for a non-integer."""

    kind = "int"

    def __init__(self, name: str, default: Union[int, Callable[[], int], None], doc: str, *,
                 minimum: Optional[int] = None, what: str = "an integer", **kw: Any) -> None:
        super().__init__(name, default, doc, **kw)
        self.minimum = minimum
        self.what = what

    def convert(self, text: str) -> int:
        n = self._parsed(text, int, f"not {self.what}")
        if self.minimum is not None and n < self.minimum:
            raise self.error(f"{self.name}={n}: must be at least {self.minimum}")
        return n


class EnvFloat(EnvSetting[float]):
    """A number (``2``, ``0.05``, ``1e-3``); with ``positive``, greater than zero."""

    kind = "float"

    def __init__(self, name: str, default: Union[float, Callable[[], float], None], doc: str, *,
                 positive: bool = True, **kw: Any) -> None:
        super().__init__(name, default, doc, **kw)
        self.positive = positive

    def convert(self, text: str) -> float:
        v = self._parsed(text, float, "not a number (e.g. 30, 2.5, 0.05)")
        if v != v or v in (float("inf"), float("-inf")):
            raise self.fail(text, "not a finite number")
        if self.positive and v <= 0:
            raise self.fail(text, "must be positive")
        return v


class EnvBytes(EnvSetting[int]):
    """A byte count in :func:`mscclang.units.parse_bytes`'s grammar (``4096``, ``64K``,
    ``1MiB``, ``1.5G``), at least ``minimum`` bytes."""

    kind = "bytes"

    def __init__(self, name: str, default: Union[int, Callable[[], int], None], doc: str, *,
                 minimum: int = 0, **kw: Any) -> None:
        super().__init__(name, default, doc, **kw)
        self.minimum = minimum

    def convert(self, text: str) -> int:
        n = self._parsed(text, parse_bytes, f"not a byte count (e.g. {BYTE_COUNT_EXAMPLES})")
        if n < self.minimum:
            raise self.fail(text, f"must be at least {self.minimum} bytes" if self.minimum > 1
                            else "must be positive")
        return n

    def show(self, value: Any) -> str:
        return "(unset)" if value is None else f"{value} ({format_bytes(value)})"


class EnvChoice(EnvSetting[str]):
    """One of ``choices`` (case-insensitive); ``aliases`` maps other spellings to a choice."""

    kind = "choice"

    def __init__(self, name: str, default: str, choices: Sequence[str], doc: str, *,
                 aliases: Optional[Mapping[str, str]] = None, **kw: Any) -> None:
        super().__init__(name, default, doc, **kw)
        self.choices = tuple(choices)
        self.aliases = dict(aliases or {})
        if default not in self.choices or not set(self.aliases.values()) <= set(self.choices):
            raise ValueError(f"setting {name}: the default and the aliases must be among {self.choices}")

    def convert(self, text: str) -> str:
        t = text.lower()
        t = self.aliases.get(t, t)
        if t not in self.choices:
            raise self.fail(text, f"use {', '.join(self.choices[:-1])} or {self.choices[-1]}")
        return t


def default_sim_max_memory() -> int:
    """Three quarters of the machine's physical memory (8 GiB when it cannot be read; at least
    1 GiB): the default of ``MSCCLANG_SIM_MAX_MEMORY``. No fixed cap: a simulation that fits in
    the machine's memory is not refused for a fixed cap."""
    cap = 8 << 30
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return cap
    return int(max(total * 3 // 4, 1 << 30))


class Settings:
    """The ``MSCCLANG_*`` settings of one environment (``environ``, default ``os.environ``,
    read at every access). Every attribute below is one variable; see the module docstring."""

    def __init__(self, environ: Optional[Mapping[str, str]] = None) -> None:
        self._environ = environ

    @property
    def environ(self) -> Mapping[str, str]:
        """The mapping the settings are read from."""
        return os.environ if self._environ is None else self._environ

    def is_set(self, attr: str) -> bool:
        """Whether the variable of setting ``attr`` is set to a non-blank value (so the setting
        is not its default), e.g. ``settings.is_set("timeout_s")``."""
        s = vars(Settings).get(attr)
        if not isinstance(s, EnvSetting):
            raise AttributeError(f"Settings has no setting {attr!r}")
        return bool(str(self.environ.get(s.name, "")).strip())

    # --- the collective API (mscclang.Communicator) and registration of ordinary tensors
    register = EnvChoice(
        "MSCCLANG_REGISTER", "off", ("auto", "explicit", "off"),
        "registration of ordinary tensors: auto (on the collective API's own schedule), explicit "
        "(register, prepare, graph capture only) or off (stage them)",
        default_doc="off (designed: auto)", error=InvalidCall)
    staging_cap_bytes = EnvBytes(
        "MSCCLANG_STAGING_CAP_BYTES", 1 << 62,
        "staging kept between calls; a call that needs more gets staging of its own, released after it",
        default_doc="no cap (designed: 128 MiB)", error=InvalidCall)
    staging_min_bytes = EnvBytes(
        "MSCCLANG_STAGING_MIN_BYTES", 32 << 20,
        "the GPU collective API's staging is allocated at least this large (at most the cap), so new "
        "message sizes up to it reuse it with no collective allocation; above it, staging grows in powers of two",
        error=InvalidCall)
    max_registrations = EnvInt(
        "MSCCLANG_MAX_REGISTRATIONS", 64,
        "registrations kept; beyond, the least recently used is dropped (alike on every rank)",
        minimum=1, error=InvalidCall)
    graph_arena_bytes = EnvBytes(
        "MSCCLANG_GRAPH_ARENA_BYTES", 4 << 20,
        "device-plan arena of a CUDA-graph capture session (16 KiB per captured zero-copy call)",
        error=InvalidCall)
    check_registration = EnvBool(
        "MSCCLANG_CHECK_REGISTRATION", False,
        "compare every zero-copy call's buffers across ranks (one store round trip per call)",
        error=InvalidCall)
    tuning = EnvStr(
        "MSCCLANG_TUNING", None,
        "tuning table of the collective API: a file or JSON text (unset: the shipped 2x H200 table)",
        check="mscclang.comm.tuning:load_tuning")
    plans_dir = EnvPath(
        "MSCCLANG_PLANS_DIR", None,
        "folder of the plans the collective API chooses from (unset: the checkout's or the installed plans/); "
        "a folder that is missing or holds no plan is refused", folder=True, check="mscclang.comm.catalog:check_plans_dir")
    batch_invariant = EnvBool(
        "MSCCLANG_BATCH_INVARIANT", False,
        "batch-invariant mode: every reduction runs a plan that sums in rank order at every size (docs/semantics.md); "
        "a call no such plan serves raises, never falls back to torch.distributed",
        error=InvalidCall)
    comm_granule = EnvInt(
        "MSCCLANG_COMM_GRANULE", None,
        "force one padding granule (elements) for every collective call (unset: the plan's alignment)",
        minimum=1, error=InvalidCall)

    # --- the GPU runtime
    timeout_s = EnvFloat(
        "MSCCLANG_TIMEOUT_S", 30.0,
        "seconds every GPU spin (and the fallback's NCCL watchdog) waits before giving up",
        error=InvalidCall)
    max_launch_entries = EnvInt(
        "MSCCLANG_MAX_LAUNCH_ENTRIES", 512,
        "launch entries (one per call shape) kept per communicator; beyond, the least recently used that "
        "no prepare or captured graph holds are evicted with their device plans (alike on every rank)",
        minimum=16, error=RuntimeUnavailable)
    async_error = EnvChoice(
        "MSCCLANG_ASYNC_ERROR", "raise", ("raise", "abort", "log"),
        "what the watchdog does when a launch gave up and no host call would notice: raise in the "
        "launching thread, abort the process, or log",
        error=RuntimeUnavailable)
    watchdog_poll_s = EnvFloat(
        "MSCCLANG_WATCHDOG_POLL_S", 0.05, "seconds between the watchdog's looks at the abort word",
        error=RuntimeUnavailable)
    enable_nvls = EnvBool(
        "MSCCLANG_ENABLE_NVLS", False,
        "allow plans with switch channels (NVLink multicast); never on a machine that forbids it",
        error=RuntimeUnavailable)
    gpus_per_node = EnvInt(
        "MSCCLANG_GPUS_PER_NODE", None,
        "GPUs per node, overriding the launcher's LOCAL_WORLD_SIZE (1: one host's GPUs as one-GPU nodes)",
        minimum=1, what="a number of GPUs per node", default_doc="LOCAL_WORLD_SIZE, else every rank",
        error=RuntimeUnavailable)
    ranks_per_gpu = EnvInt(
        "MSCCLANG_RANKS_PER_GPU", 1,
        "worker processes per GPU, for functional tests on fewer GPUs than ranks (timings mean nothing; "
        "their kernels time-share the GPU, so many processes at once can slow a collective to the timeout)",
        minimum=1, error=WorkerError)
    specialize = EnvChoice(
        "MSCCLANG_SPECIALIZE", "auto", ("auto", "always", "never"),
        "plan-specialised kernels: auto (built in the background: small sizes from their second call, "
        "larger ones once prepared or hot), always (at the first call), or never (the interpreter only)",
        aliases={"1": "always", "on": "always", "force": "always", "0": "never", "off": "never",
                 "interpreter": "never"},
        error=RuntimeUnavailable)
    spec_first_bytes = EnvBytes(
        "MSCCLANG_SPEC_FIRST_BYTES", 256 << 10,
        "largest message auto specialises at its first call (never above MSCCLANG_SPEC_MAX_BYTES)",
        error=RuntimeUnavailable)
    spec_max_bytes = EnvBytes(
        "MSCCLANG_SPEC_MAX_BYTES", 64 << 20, "largest message (input or output bytes) auto specialises",
        error=RuntimeUnavailable)
    spec_hot_calls = EnvInt(
        "MSCCLANG_SPEC_HOT_CALLS", 3,
        "calls of one signature after which auto builds the kernel of a size above MSCCLANG_SPEC_FIRST_BYTES",
        minimum=1, error=RuntimeUnavailable)
    spec_flags = EnvChoice(
        "MSCCLANG_SPEC_FLAGS", "early", ("early", "end"),
        "when a specialised kernel's block advances its flag: early (after its first op) or end "
        "(after its last, as the interpreter does)", error=SpecUnsupported)
    spec_threads = EnvStr(
        "MSCCLANG_SPEC_THREADS", "auto",
        "threads per block of specialised kernels: auto (fewest warps the data needs), plan (the "
        "plan's count) or a count 1..1024")
    executor_dir = EnvPath(
        "MSCCLANG_EXECUTOR_DIR", None,
        "folder of the executor's CUDA sources (unset: the checkout's executor/ or the installed copy)", folder=True)
    cache_dir = EnvPath(
        "MSCCLANG_CACHE_DIR", None, "disk cache of built kernels (a folder, made when missing)",
        default_doc="$XDG_CACHE_HOME/mscclang, else ~/.cache/mscclang", folder=True, made=True)
    cubin_dir = EnvPath(
        "MSCCLANG_CUBIN_DIR", None,
        "folder of prebuilt kernels (mscclang build-kernel --out), looked up before building with NVRTC", folder=True)

    # --- plans and the simulator
    max_plan_bytes = EnvBytes(
        "MSCCLANG_MAX_PLAN_BYTES", 32 << 20, "largest plan file (or JSON text) mscclang reads",
        minimum=1, error=LimitError)
    max_plan_ops = EnvInt(
        "MSCCLANG_MAX_PLAN_OPS", 100_000, "most ops a plan may hold (pipeline inner ops included)",
        minimum=1, error=LimitError)
    compile_max_ranks = EnvInt(
        "MSCCLANG_COMPILE_MAX_RANKS", 4096, "most ranks a DSL program may have", minimum=1, error=LimitError)
    compile_max_ops = EnvInt(
        "MSCCLANG_COMPILE_MAX_OPS", 1_000_000,
        "most ops a DSL program may record, times its instances (the compiler's work and memory grow with them)",
        minimum=1, error=LimitError)
    sim_max_memory = EnvBytes(
        "MSCCLANG_SIM_MAX_MEMORY", default_sim_max_memory, "bytes one simulation may use",
        minimum=1, default_doc="three quarters of the machine's memory", error=LimitError)
    sim_max_seconds = EnvFloat(
        "MSCCLANG_SIM_MAX_SECONDS", 600.0, "seconds a verify (or one run) may take", error=LimitError)

    # --- tools
    bench_debug = EnvBool(
        "MSCCLANG_BENCH_DEBUG", False, "print the traceback of every failed benchmark cell")

    # --- variables of other programs
    local_world_size = EnvVar(
        "LOCAL_WORLD_SIZE", "GPUs per node, set by torchrun and launchers like it (MSCCLANG_GPUS_PER_NODE overrides it)")
    cuda_device_max_connections = EnvVar(
        "CUDA_DEVICE_MAX_CONNECTIONS",
        "CUDA's hardware work queues per process (default 8, at most 32), read when the process first uses CUDA; "
        "plans need one per port channel side stream beside the launching stream. mscclang's GPU workers start "
        "with 32 unless it is set")
    pytorch_cuda_alloc_conf = EnvVar(
        "PYTORCH_CUDA_ALLOC_CONF", "torch's allocator settings, compared across ranks before a CUDA-graph capture session")
    pytorch_alloc_conf = EnvVar("PYTORCH_ALLOC_CONF", "the newer name of PYTORCH_CUDA_ALLOC_CONF, compared alike")
    xdg_cache_home = EnvVar(
        "XDG_CACHE_HOME", "the user's cache folder: the kernel cache is its mscclang/ (unless MSCCLANG_CACHE_DIR)")
    nccl_nvls_enable = EnvVar(
        "NCCL_NVLS_ENABLE", "NCCL's NVLink multicast: set to 0 before mscclang starts NCCL, always; it must never "
        "be enabled on the machines mscclang runs on")
    nccl_p2p_disable = EnvVar(
        "NCCL_P2P_DISABLE", "set to 1 by `mscclang bench --gpus-per-node` (NCCL between one host's \"nodes\" "
        "takes its network path)")
    nccl_shm_disable = EnvVar("NCCL_SHM_DISABLE", "set to 1 with NCCL_P2P_DISABLE")


#: the settings of this process's environment
settings = Settings()


@dataclass(frozen=True)
class SettingInfo:
    """One row of the settings table: the variable, the attribute of :class:`Settings`, its
    kind, its default and its current value as text (``value`` None when the variable is unset),
    its one-line description, the words a choice accepts, and why the current value is refused
    (``problem``, None when it is accepted)."""

    name: str
    attr: str
    kind: str
    default: str
    value: Optional[str]
    doc: str
    choices: tuple[str, ...] = ()
    problem: Optional[str] = None


def declared() -> list[EnvSetting[Any]]:
    """Every setting, in declaration order."""
    return [v for v in vars(Settings).values() if isinstance(v, EnvSetting)]


def externals() -> list[EnvVar]:
    """Every variable of another program that mscclang reads or sets, in declaration order."""
    return [v for v in vars(Settings).values() if isinstance(v, EnvVar) and not isinstance(v, EnvSetting)]


def nccl_env(network_only: bool = False) -> dict[str, str]:
    """The variables NCCL must run with, for ``os.environ.update`` before a process makes an NCCL
    communicator or spawns workers that do: NVLink multicast off (``NCCL_NVLS_ENABLE=0``), always,
    since it must never be enabled on the machines mscclang runs on. ``network_only`` also keeps
    NCCL off peer-to-peer and shared memory, so that ranks of one host talk as over the network."""
    env = {Settings.nccl_nvls_enable.name: "0"}
    if network_only:
        env.update({Settings.nccl_p2p_disable.name: "1", Settings.nccl_shm_disable.name: "1"})
    return env


def worker_env(of: Optional[Settings] = None) -> dict[str, str]:
    """The variables a process that mscclang starts to run a GPU rank gets before it first uses
    CUDA: :func:`nccl_env`, and ``CUDA_DEVICE_MAX_CONNECTIONS`` at CUDA's most unless ``of``
    (default :data:`settings`) sets it, so that every port channel's side stream has a hardware
    work queue of its own."""
    queues = (settings if of is None else of).cuda_device_max_connections
    return {**nccl_env(), Settings.cuda_device_max_connections.name: queues or str(CUDA_MAX_CONNECTIONS)}


def describe(of: Optional[Settings] = None) -> list[SettingInfo]:
    """Every setting with its default and its value in ``of`` (default :data:`settings`); a value
    the setting refuses (:meth:`EnvSetting.checked`: a file or folder its reader refuses too) is
    shown as the raw text, with the reason in ``problem``."""
    of = settings if of is None else of
    rows = []
    for s in declared():
        raw = of.environ.get(s.name)
        value: Optional[str] = None
        problem: Optional[str] = None
        if raw is not None:
            try:
                value = s.show(s.checked(raw))
            except Exception as e:  # any refusal (its class is the setting's) is reported, not raised
                value, problem = repr(raw), str(e)
        default = s.default_doc if s.default_doc is not None else s.show(s.default_value())
        choices = s.choices if isinstance(s, EnvChoice) else ()
        rows.append(SettingInfo(s.name, s.attr, s.kind, default, value, s.doc, choices, problem))
    return rows


def settings_text(of: Optional[Settings] = None) -> str:
    """The table ``mscclang env`` prints: one block per setting, its value (or ``default``)."""
    lines = []
    for r in describe(of):
        now = r.value if r.value is not None else f"default: {r.default}"
        if r.problem:
            now += f"  INVALID: {r.problem}"
        lines.append(f"{r.name} = {now}\n    {r.kind}; {r.doc}")
    return "\n".join(lines) + "\n"


def settings_markdown() -> str:
    """``docs/settings.md``: every setting with its kind, default and description, then every
    variable of another program with its meaning (generated; ``python3 -m mscclang env --markdown >
    docs/settings.md`` rewrites it)."""
    head = ("# Settings\n\n"
            "<!-- generated from mscclang/config.py by `python3 -m mscclang env --markdown`; do not edit -->\n\n"
            "Every `MSCCLANG_*` environment variable mscclang reads. Each is read when it is needed, "
            "never cached; unset or blank means the default. A value a setting does not accept is an "
            "error naming the variable and what it accepts. `python3 -m mscclang env` prints the "
            "values in effect and marks each one that would be refused (a file or folder included) with the reason.\n\n"
            "Kinds: `bool` is 1/true/yes/on or 0/false/no/off; `bytes` is a byte count such as "
            f"{', '.join(f'`{x}`' for x in BYTE_COUNT_EXAMPLES.split(', '))} (K = 1024 bytes; K, M, G, T "
            "with optional `B` or `iB`); `choice` is one of the listed words; `path` is a file or "
            "folder (one that must be a folder refuses anything else).\n\n"
            "Every rank of a job must use the same settings.\n\n"
            "| variable | kind | default | what it does |\n|---|---|---|---|\n")
    rows = []
    for r in describe(Settings({})):
        choices = f"`{'`, `'.join(r.choices)}`: " if r.choices else ""
        rows.append(f"| `{r.name}` | {r.kind} | {r.default} | {choices}{r.doc} |")
    rows += ["", "## Variables of other programs", "",
             "mscclang reads or sets these variables of NCCL, CUDA, torch and launchers (declared in "
             "`mscclang/config.py` too; mscclang never enables NCCL's NVLink multicast).", "",
             "| variable | what it means to mscclang |", "|---|---|"]
    rows += [f"| `{v.name}` | {v.doc} |" for v in externals()]
    return head + "\n".join(rows) + "\n"
