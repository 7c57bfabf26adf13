"""Apply / revert machinery and the status report. One lock; the shipped objects are kept once.

Applying: every fix's check runs on the shipped code; ``targets.build`` builds one replacement per target from
the set of fixes found broken; every fix found broken must pass its own check on the replacements, or is left
out and the replacements rebuilt without it; then they are installed.
What is *applied* is never a stored flag: it is read off the live module (is the attribute our
replacement?), so a reload of diffusers' module or someone else's patch cannot leave the report stale.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import _switches
from ._advice import decide
from ._fix import Finding, Fix, release_table_lists
from ._warnings import FixNotAppliedWarning, ReleaseTableMismatchWarning, StaleReferenceWarning, explain, logger, report
from .fixes import ALL_FIXES

if TYPE_CHECKING:
    from ._report import ReasonCode, Report

MODULE_NAME = _switches.MODULE_NAME

# Never hold diffusers' private ops: the reference scan skips them.
_SCAN_SKIP = frozenset({"torch", "diffusers_cudnn_fix", *sys.stdlib_module_names})


#: Why a fix is not applied, by what its check found (broken: applied, or skipped or failed): code, words.
_UNFIXED: dict[str, tuple[ReasonCode, str]] = {
    "ok": ("not_needed", "not needed"),
    "absent": ("not_applicable", "not applicable"),
    "unknown": ("unknown", "left alone, behaviour unknown"),
}

#: What apply() warns of, by reason code (skipped: where the fix is found broken).
_UNFIXED_MEANS = "Training that meets it under context parallelism may give wrong gradients."
_WARNINGS = {  # cause and way out; the consequence is _UNFIXED_MEANS
    "skipped": (f"'{{id}}' ({{title}}) is broken here, left unfixed because {_switches.SKIP_VAR} names it.",
                f"Remove it from {_switches.SKIP_VAR} to have it fixed."),
    "failed": ("'{id}' NOT applied: {reason}.", "Please report your diffusers and torch versions."),
    "unknown": ("'{id}' ({title}) {reason}.", "Please report your diffusers version."),
}  # fmt: skip

#: What the release table says against the check, by (state found, release listed as carrying the bug).
_MISMATCHES: dict[tuple[str, bool | None], str] = {
    ("absent", True): "carries '{}', but the functions it patches are not there (renamed?): nothing to fix",
    ("ok", True): "carries '{}', but the installed code does not",
    ("broken", False): "does not carry '{}', but the installed code does",
}
_ON_MISMATCH = ("The package acts on what its check finds in the code.", "Please report your diffusers version.")


@dataclass(frozen=True)
class _Record:
    """What ``apply`` found and did for one fix."""

    finding: Finding  # what the check found on the shipped code
    reason: str
    code: ReasonCode


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.module: ModuleType | None = None
        # Targets are attribute paths in diffusers' module: "_cudnn_attention_forward_op" or
        # "TemplatedRingAttention.backward". Objects are stored raw (a class's staticmethod, not its function).
        self.originals: dict[str, Any] = {}  # target -> the object that was there before us
        self.installed: dict[str, Any] = {}  # target -> our replacement
        self.policies: dict[str, frozenset[str]] = {}  # target -> the fixes whose policies its replacement has
        self.records: dict[str, _Record] = {}
        self.seen: dict[str, Any] = {}  # every target as apply() left it: a change means "check again"
        self.rebound: list[tuple[str, str, Any, Any]] = []  # (module name, global name, original, ours)
        self.stale: list[str] = []
        self.announced = False
        self.mismatches_reported: set[str] = set()


_state = _State()


def _fixes() -> tuple[Fix, ...]:
    """Every fix; none where torch is not installed (then there is nothing to check or fix)."""
    return ALL_FIXES if "torch" in sys.modules or importlib.util.find_spec("torch") is not None else ()


def check_of(fix: Fix) -> Any:
    """The fix's behavioural check, ``check`` in ``fixes/<id>.py`` (imported here: it needs torch)."""
    return importlib.import_module(f"{__package__}.fixes.{fix.id}").check


def _diffusers_version() -> str | None:
    version = getattr(sys.modules.get("diffusers"), "__version__", None)
    return None if version is None else str(version)


def _holder(module: ModuleType | None, target: str) -> tuple[Any, Any]:
    """What holds ``target`` (the module, the class of ``Class.attr``, or the dict ``Class.attr`` of
    ``Class.attr[key]``; None if missing), and its name there (or the dict's own key, None if it has none).
    ``module:...``: in that module, if imported."""
    if ":" in target:
        name, _, target = target.partition(":")
        module = sys.modules.get(name)
    if target.endswith("]"):
        path, _, key = target[:-1].partition("[")
        holder: Any = module
        for part in path.split("."):
            holder = getattr(holder, part, None)
        if not isinstance(holder, dict):
            return None, key
        # diffusers' backend names are str enums, equal to their value but hashed by their member name: the key
        # is found by comparison, not by hash.
        return holder, next((k for k in holder if k == key), None)
    owner, _, name = target.rpartition(".")
    return (getattr(module, owner, None) if owner else module), name


def raw_get(module: ModuleType | None, target: str) -> Any:
    """The object stored at ``target`` (a class's own ``__dict__`` entry for ``Class.attr``, a dict's entry for
    ``Class.attr[key]``), or None."""
    holder, name = _holder(module, target)
    if isinstance(holder, dict):
        return holder.get(name)
    return holder.__dict__.get(name) if isinstance(holder, type) else getattr(holder, name, None)


def raw_set(module: ModuleType | None, target: str, value: Any) -> None:
    holder, name = _holder(module, target)
    if isinstance(holder, dict):
        holder[name] = value  # only ever an entry that is there (raw_get found it)
    else:
        setattr(holder, name, value)


def callable_of(obj: Any) -> Any:
    """What calling code gets for a stored object: a staticmethod's function."""
    return obj.__func__ if isinstance(obj, staticmethod) else obj


@dataclass
class Objects:
    """A check's view of diffusers' module: ``candidates`` (replacements being verified, built by ``targets.build``
    for the ``broken`` fixes) where given, else what diffusers shipped; ``shipped(name)`` what diffusers shipped
    (or, in a view made by :meth:`built`, the check's stand-in for it: ``standing_in``)."""

    module: ModuleType
    candidates: dict[str, Any] = field(default_factory=dict)
    broken: frozenset[str] = frozenset()
    standing_in: dict[str, Any] = field(default_factory=dict)
    facts: Any = None  # targets.Facts of the build being verified: read off diffusers' code, not a check's stand-ins
    siblings: dict[str, Any] | None = None  # what was built with the candidates (default: the candidates)

    def shipped(self, name: str) -> Any:
        if name in self.standing_in:
            return self.standing_in[name]
        kept = _state.originals if _state.module is self.module else {}
        return callable_of(kept[name] if name in kept else raw_get(self.module, name))

    def __call__(self, name: str) -> Any:
        return callable_of(self.candidates[name]) if name in self.candidates else self.shipped(name)

    def built(self, name: str, around: Any, /, **seams: Any) -> Any:
        """``name`` as a check runs it with its own collaborators (``_fix.built_of``): diffusers' own code is
        ``around``; a replacement is built again, by the same builder, around ``around`` with ``seams``."""
        if name not in self.candidates:
            return around
        from .targets import build

        view = Objects(self.module, standing_in={**self.standing_in, name: around})
        built_with = self.candidates if self.siblings is None else self.siblings
        siblings = {target: new for target, new in built_with.items() if target != name}
        rebuilt = build(view, self.broken, facts=self.facts, diffusers=self.module, siblings=siblings, **seams)
        return callable_of(rebuilt.get(name))


def check_live(module: ModuleType) -> dict[str, Finding]:
    """Every fix's check on the objects installed now (the doctor's "after patching" view)."""
    with _state.lock:
        return {fix.id: check_of(fix)(live_objects(module)) for fix in _fixes()}


def live_objects(module: ModuleType) -> Objects:
    """The objects installed in ``module`` now, as a check sees them (the replacements rebuilt on demand)."""
    from .targets import Facts

    with _state.lock:
        installed = {t: raw_get(module, t) for t in _state.installed}
        broken = frozenset(i for ids in _state.policies.values() for i in ids)
        # A rebuild is handed what apply() built with the replacement, even where someone replaced one since.
        return Objects(module, installed, broken, facts=Facts(Objects(module)), siblings=dict(_state.installed))


def check_shipped(module: ModuleType) -> dict[str, Finding]:
    """Every fix's check on the code diffusers shipped (what apply() kept, else the live objects): what the installed
    release needs, whether the package is on, switched off or reverted (``verify``'s accounting)."""
    with _state.lock:
        return {fix.id: check_of(fix)(Objects(module)) for fix in _fixes()}


def _ours(module: ModuleType | None, target: str) -> bool:
    return target in _state.installed and raw_get(module, target) is _state.installed[target]


def _applied(module: ModuleType | None, fix: Fix) -> bool | None:
    """Whether the replacements apply() installed for ``fix`` are all in ``module`` now; None: it installed none."""
    mine = [t for t in fix.targets if fix.id in _state.policies.get(t, ())]
    return all(_ours(module, t) for t in mine) if mine else None


def _up_to_date(module: ModuleType, skipped: frozenset[str]) -> bool:
    """Whether the last apply() still describes ``module``: nothing of ours gone, no target changed by someone
    else, and no fix found broken and skipped then that is no longer skipped."""
    if _state.module is not module or not _state.seen:
        return False
    if any(raw_get(module, t) is not obj for t, obj in _state.seen.items()):
        logger.info("%s: changed since it was checked (imported, reloaded or re-patched); re-checking", MODULE_NAME)
        return False
    return not any(
        r.code == "skipped" and r.finding.state == "broken" and i not in skipped for i, r in _state.records.items()
    )


def _put_back(module: ModuleType | None, *, reverting: bool) -> None:
    """Put back the shipped objects in ``module`` (None: nothing to put back) where ours are still installed,
    and forget what we installed. ``reverting``: also the globals we rebound, and say what someone else
    changed since."""
    for mod_name, global_name, original, ours in _state.rebound if reverting else ():
        namespace = getattr(sys.modules.get(mod_name), "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(global_name) is ours:
            namespace[global_name] = original
    for target, original in _state.originals.items():
        if _ours(module, target):
            raw_set(module, target, original)
        elif reverting:
            logger.warning("%s.%s was changed by someone else since we patched it; left as is", MODULE_NAME, target)
    for kept in (_state.originals, _state.installed, _state.policies, _state.seen, _state.rebound, _state.stale):
        kept.clear()


def _reset(module: ModuleType) -> None:
    """Put back what we installed (where it is still ours) and forget every check: the next apply starts over."""
    _put_back(module if _state.module is module else None, reverting=False)
    _state.module = module
    _state.records.clear()


def apply_to(module: ModuleType, *, scan_references: bool = True) -> None:
    """Check every fix against ``module`` and install what it shows broken. Idempotent, thread-safe.

    ``scan_references``: afterwards, rebind other modules' globals that still hold a shipped op. The hook
    skips it when it fires on the module's first import, when nobody can hold one yet.
    """
    with _state.lock:
        if not _switches.enabled():
            return
        # Every spelling DIFFUSERS_CUDNN_FIX_SKIP accepts (ids and old ids) -> the fix id.
        skipped = _switches.skipped_fixes({name: fix.id for fix in _fixes() for name in (fix.id, *fix.old_ids)})
        if _up_to_date(module, skipped):
            return
        _reset(module)
        try:
            _check_and_install(module, skipped)
        except BaseException:
            _reset(module)  # nothing half-applied
            raise
        if scan_references:
            _rebind_references(module)
        _announce(module)


def _check_and_install(module: ModuleType, skipped: frozenset[str]) -> None:
    """Check every fix on the shipped code, build and verify the replacements, install them; record each fix."""
    fixes = _fixes()
    findings = check_shipped(module)
    wanted = {i for i, f in findings.items() if f.state == "broken" and i not in skipped}
    built, failed = _build(module, wanted, findings)
    applied = wanted - failed.keys()
    for target, new in built.items():
        _state.originals[target] = raw_get(module, target)
        raw_set(module, target, new)
        _state.installed[target] = new
        _state.policies[target] = frozenset(f.id for f in fixes if target in f.targets and f.id in applied)
    for fix in fixes:
        finding = findings[fix.id]
        code: ReasonCode
        if fix.id in skipped:  # checked all the same, so that the report says whether skipping leaves a bug in place
            code, reason = "skipped", f"skipped by {_switches.SKIP_VAR}"
        elif fix.id in failed:
            code, reason = "failed", failed[fix.id]
        elif finding.state == "broken":
            code = "fixed" if fix.kind == "correction" else "guarded"
            reason = f"{code}: {finding.detail}"
        else:
            code, words = _UNFIXED[finding.state]
            reason = f"{words}: {finding.detail}"
        _state.records[fix.id] = _Record(finding, reason, code)
        if code in _WARNINGS and (code != "skipped" or finding.state == "broken"):
            one_line = " ".join(reason.split())
            cause, way_out = (p.format(id=fix.id, title=fix.title, reason=one_line) for p in _WARNINGS[code])
            report(explain(cause, _UNFIXED_MEANS, way_out, f"fixes.md#{fix.id}"), FixNotAppliedWarning)
    _state.seen = {t: raw_get(module, t) for fix in fixes for t in fix.targets}


def _build(module: ModuleType, wanted: set[str], findings: dict[str, Finding]) -> tuple[dict[str, Any], dict[str, str]]:
    """The replacements for the ``wanted`` fixes, every one of which passes its own check on them; the fixes left
    out, with why. ``findings``: the checks' on the shipped code (what they read there is not read again)."""
    from .targets import Facts, build

    wanted, failed = set(wanted), {}
    facts = Facts(Objects(module), findings)  # read off diffusers' code once, for every build and rebuild below
    while True:
        try:
            built = build(Objects(module), frozenset(wanted), facts=facts, diffusers=module) if wanted else {}
        except Exception as exc:  # noqa: BLE001 - a failing build leaves diffusers as shipped
            built = {}
            failed.update(dict.fromkeys(wanted, f"building the replacements failed: {type(exc).__name__}: {exc}"))
        candidates = Objects(module, built, frozenset(wanted), facts=facts)
        verified = {f.id: check_of(f)(candidates) for f in _fixes() if f.id in wanted and f.id not in failed}
        failed.update({fix_id: found.detail for fix_id, found in verified.items() if found.state != "ok"})
        if not wanted & failed.keys():
            why = "found broken, but the replacement did not pass the same check"
            return built, {i: f"{why} ({detail})" for i, detail in failed.items()}
        wanted -= failed.keys()


def _scanned_package(top: str) -> bool:
    """Whether the reference scan reads the modules of package ``top``: diffusers' own and the user's code, not
    third-party packages."""
    # Read the namespace, not the attribute: a lazy module's __getattr__ must not run (it may import).
    namespace = getattr(sys.modules.get(top), "__dict__", None)
    path = (namespace.get("__file__") if isinstance(namespace, dict) else None) or ""
    third_party = top in _SCAN_SKIP or "site-packages" in path or "dist-packages" in path
    return top == "diffusers" or not third_party


def _rebind_references(module: ModuleType) -> None:
    """Rebind module globals that still hold a shipped op (``from ... import _cudnn_..._op`` copies)."""
    # Module-level functions only: a class attribute's staticmethod object is never imported elsewhere.
    by_id = {id(orig): t for t, orig in _state.originals.items() if orig is not None and "." not in t}
    if not by_id:
        return
    for mod_name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if mod is module or not isinstance(namespace, dict) or not _scanned_package(mod_name.partition(".")[0]):
            continue
        for global_name, value in list(namespace.items()):
            target = by_id.get(id(value))  # the originals are alive: the same id is the same object
            if target is None:
                continue
            ours = _state.installed[target]
            try:
                namespace[global_name] = ours
            except Exception:  # noqa: BLE001 - a read-only namespace: say so instead
                ref = f"{mod_name}.{global_name}"
                _state.stale.append(ref)
                report(explain(f"{ref} holds the shipped {target} and could not be rebound.", "Calls through it "
                               "still use the buggy op.", "Import diffusers_cudnn_fix before diffusers.",
                               "api.md#what-importing-it-does"), StaleReferenceWarning)  # fmt: skip
            else:
                _state.rebound.append((mod_name, global_name, value, ours))
                logger.info("rebound %s.%s to the corrected %s", mod_name, global_name, target)


def _announce(module: ModuleType) -> None:
    """Say what was applied, where the release table and the check disagree, and (once) the advice."""
    version = _diffusers_version()
    states = {fix_id: record.finding.state for fix_id, record in _state.records.items()}
    for fix in _fixes():
        mismatch = _MISMATCHES.get((states[fix.id], release_table_lists(fix.affected, version)))
        # A bug the environment spares this process (Fix.environment) is no disagreement with the table: the
        # release carries it, and a process of another environment finds it.
        if _state.records[fix.id].finding.by_environment:
            mismatch = None
        if mismatch is not None and fix.id not in _state.mismatches_reported:
            _state.mismatches_reported.add(fix.id)
            cause = f"the release table says diffusers {version} {mismatch.format(fix.id)}."
            report(explain(cause, *_ON_MISMATCH, f"fixes.md#{fix.id}"), ReleaseTableMismatchWarning)
    applied = [fix.id for fix in _fixes() if _applied(module, fix)]
    if applied:
        logger.info("diffusers_cudnn_fix: diffusers %s: applied %s", version, ", ".join(applied))
    if not _state.announced:
        logger.info("diffusers_cudnn_fix: %s", decide(states, version).line())
    _state.announced = True


def revert() -> Report:
    """Put back exactly the objects that were there before us. Idempotent, thread-safe."""
    with _state.lock:
        _put_back(_state.module, reverting=True)  # None before any apply: nothing to put back
        for fix in _fixes():
            # A policy that gives something outside the targets (cp_split_warning_once: a method lent to one logger
            # of diffusers) takes it back in its module's take_back(); a fix module not imported gave nothing
            # (revert() works without torch).
            take_back = getattr(sys.modules.get(f"{__package__}.fixes.{fix.id}"), "take_back", None)
            if take_back is not None:
                take_back()
        for fix_id, record in _state.records.items():
            _state.records[fix_id] = replace(record, reason="reverted by revert()", code="reverted")
        return status()


def original(target: str) -> Any:
    """The object at ``diffusers.models.attention_dispatch.<target>`` before we patched it.

    ``target`` is an attribute or ``Class.attribute`` path; a class attribute comes back as stored (a
    staticmethod stays one). Returns the live object when we did not patch it, so callers always get the
    shipped code.
    """
    with _state.lock:
        return _state.originals[target] if target in _state.originals else raw_get(sys.modules.get(MODULE_NAME), target)


def is_patched(target: str) -> bool:
    """Whether our object sits at ``diffusers.models.attention_dispatch.<target>`` right now."""
    with _state.lock:
        return _ours(sys.modules.get(MODULE_NAME), target)


_LOST = "was fixed, but the module no longer holds our replacement (reloaded?): call apply()"


def status() -> Report:
    """A structured report of versions and of every fix's state (see :class:`Report`)."""
    from ._report import FixStatus, Report

    with _state.lock:
        enabled = _switches.enabled()
        module = sys.modules.get(MODULE_NAME)
        version = _diffusers_version()
        fixes = []
        for fix in _fixes():
            record = _state.records.get(fix.id) if module is _state.module else None
            installed = _applied(module, fix)
            applied = bool(installed)
            code: ReasonCode
            if not enabled and not applied:
                code, reason = "disabled", f"package switched off by {_switches.ENABLE_VAR}=0"
            elif record is not None:
                code, reason = record.code, record.reason
            elif module is not None:
                code, reason = "unchecked", "not checked: revert() disarmed the package before the import; call apply()"
            else:
                code, reason = "pending", f"{MODULE_NAME} not imported yet"
            detected = record.finding.state if record is not None and code != "disabled" else code
            if record is not None and installed is False:  # applied, and replaced since: a reload, say
                code, reason = "lost", _LOST
            if applied and fix.note is not None:
                reason = f"{reason} [{fix.note()}]"
            expected = release_table_lists(fix.affected, version)
            # The bug is (or may be) there and is not fixed; or the package is off where the table lists the bug.
            unfixed = detected in ("broken", "unknown") and not applied
            attention = expected is True if detected in ("disabled", "unchecked") else unfixed
            row = (expected, detected, applied, reason, code, attention)
            fixes.append(FixStatus(fix.id, fix.title, fix.upstream, fix.affected, *row))
        torch_mod = sys.modules.get("torch")
        probes: tuple[Any, ...] = ()
        if torch_mod is not None:  # then the fixes are there too
            from . import _devices

            probes = _devices.results()
        return Report(
            enabled=enabled,
            diffusers_version=version,
            torch_version=getattr(torch_mod, "__version__", None),
            module_loaded=module is not None,
            fixes=tuple(fixes),
            stale_references=tuple(_state.stale),
            probes=probes,
            problem="torch is not installed: there is nothing to check or fix" if not fixes else None,
        )
