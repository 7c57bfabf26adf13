"""Apply / revert machinery and the status report. One lock; the shipped objects are kept once.

What is *applied* is never a stored flag: it is read off the live module (is the attribute our
replacement?), so a reload of diffusers' module or someone else's patch cannot leave the report stale.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import _switches
from ._fix import Finding, Fix, release_table_lists
from ._warnings import FixNotAppliedWarning, ReleaseTableMismatchWarning, StaleReferenceWarning, logger, report

if TYPE_CHECKING:
    from ._report import Report

MODULE_NAME = _switches.MODULE_NAME

# Never hold diffusers' private ops: the reference scan skips them.
_SCAN_SKIP = frozenset({"torch", "diffusers_cudnn_fix"}) | frozenset(getattr(sys, "stdlib_module_names", ()))


@dataclass(frozen=True)
class _Record:
    """What ``apply`` found and did for one fix."""

    finding: Finding  # what the check found on the code as it was before we touched it
    reason: str
    skipped: bool = False
    installed: bool = False  # whether apply() put the fix in (it may have been taken out since)
    seen: tuple[Any, ...] = ()  # the objects at the fix's targets when it was checked and left alone


class _State:
    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.module: ModuleType | None = None
        # Targets are attribute paths in diffusers' module: "_cudnn_attention_forward_op" or
        # "TemplatedRingAttention.backward". Objects are stored raw (a class's staticmethod, not its function).
        self.originals: dict[str, Any] = {}  # target -> the object that was there before us
        self.installed: dict[str, Any] = {}  # target -> our outermost object
        self.owners: dict[str, list[str]] = {}  # target -> fix ids that built it, innermost first
        self.records: dict[str, _Record] = {}
        self.rebound: list[tuple[str, str, Any, Any]] = []  # (module name, global name, original, ours)
        self.stale: list[str] = []
        self.announced = False
        self.mismatches_reported: set[str] = set()


_state = _State()


def _fixes() -> tuple[Fix, ...]:
    """Every fix, in order; none where torch is not installed (then there is nothing to check or fix)."""
    try:
        from .fixes import ALL_FIXES
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        return ()
    return ALL_FIXES


def _skip_spellings() -> dict[str, str]:
    """Every spelling ``DIFFUSERS_CUDNN_FIX_SKIP`` accepts (ids and old ids) -> the fix id."""
    return {name: fix.id for fix in _fixes() for name in (fix.id, *fix.old_ids)}


def _diffusers_version() -> str | None:
    mod = sys.modules.get("diffusers")
    version = getattr(mod, "__version__", None)
    return str(version) if version is not None else None


def _expected(fix: Fix, version: str | None) -> bool | None:
    if version is None:
        return None
    return release_table_lists(fix.affected, version)


def _holder(module: ModuleType, target: str) -> tuple[Any, str]:
    *path, name = target.split(".")
    holder: Any = module
    for part in path:
        holder = getattr(holder, part, None)
    return holder, name


def raw_get(module: ModuleType, target: str) -> Any:
    """The object stored at ``target`` (a class's own ``__dict__`` entry for ``Class.attr``), or None."""
    holder, name = _holder(module, target)
    if holder is None:
        return None
    if isinstance(holder, type):
        return holder.__dict__.get(name)
    return getattr(holder, name, None)


def _raw_set(module: ModuleType, target: str, value: Any) -> None:
    holder, name = _holder(module, target)
    setattr(holder, name, value)


def callable_of(obj: Any) -> Any:
    """What calling code gets for a stored object: a staticmethod's function."""
    return obj.__func__ if isinstance(obj, staticmethod) else obj


def _ours(module: ModuleType, target: str) -> bool:
    return target in _state.installed and raw_get(module, target) is _state.installed[target]


def _applied(module: ModuleType, fix: Fix) -> bool:
    return all(fix.id in _state.owners.get(t, ()) and _ours(module, t) for t in fix.targets)


def _take_out(module: ModuleType, fix_ids: set[str]) -> None:
    """Remove these fixes, and every fix sharing a target with them, putting the originals back.

    Fixes on one target form a chain of wrappers; taking one out takes the chain out, and the next apply
    re-checks and rebuilds what is still needed.
    """
    doomed = set(fix_ids)
    changed = True
    while changed:
        changed = False
        for owners in _state.owners.values():
            if doomed.intersection(owners) and not doomed.issuperset(owners):
                doomed.update(owners)
                changed = True
    for target in [t for t, owners in _state.owners.items() if doomed.intersection(owners)]:
        if _ours(module, target):
            _raw_set(module, target, _state.originals[target])
        del _state.installed[target], _state.originals[target], _state.owners[target]
    for fix_id in doomed:
        _state.records.pop(fix_id, None)


def _forget_stale(module: ModuleType) -> None:
    """Drop what no longer describes the live module, so the next check sees the code as it is now.

    Another module object (``sys.modules`` entry replaced): start over. The same object with one of our
    objects gone (``importlib.reload``, another patcher): take the fixes on that target out, so they are
    re-checked whole.
    """
    if _state.module is not module:
        _state.module = module
        _state.originals.clear()
        _state.installed.clear()
        _state.owners.clear()
        _state.records.clear()
        _state.rebound.clear()
        _state.stale.clear()
        return
    gone = {fix_id for t, owners in _state.owners.items() if not _ours(module, t) for fix_id in owners}
    if gone:
        logger.info("%s: %s no longer in place (reloaded or re-patched); re-checking", MODULE_NAME, sorted(gone))
        _take_out(module, gone)


def apply_to(module: ModuleType, *, scan_references: bool = True) -> None:
    """Check every fix against ``module`` and install what it shows broken. Idempotent, thread-safe.

    ``scan_references``: afterwards, rebind other modules' globals that still hold a shipped op. The hook
    skips it when it fires on the module's first import, when nobody can hold one yet.
    """
    with _state.lock:
        if not _switches.enabled():
            return
        _forget_stale(module)
        skipped = _switches.skipped_fixes(_skip_spellings())
        newly: list[str] = []
        try:
            for fix in _fixes():
                if _applied(module, fix) or _checked_unchanged(module, fix):
                    continue  # an earlier apply() installed it, or checked these very objects
                if _apply_one(module, fix, skip=fix.id in skipped):
                    newly.append(fix.id)
        except BaseException:
            _take_out(module, set(newly))  # nothing half-applied: take out what this call put in
            raise
        if newly and scan_references:
            _rebind_references(module)
        _announce(newly)


def _checked_unchanged(module: ModuleType, fix: Fix) -> bool:
    record = _state.records.get(fix.id)
    if record is None or record.installed or record.skipped or not record.seen:
        return False
    return all(raw_get(module, t) is obj for t, obj in zip(fix.targets, record.seen, strict=True))


def _apply_one(module: ModuleType, fix: Fix, *, skip: bool) -> bool:
    def lookup(name: str) -> Any:
        return callable_of(raw_get(module, name))

    finding = fix.check(lookup)
    if skip:
        # Checked all the same, so that the report says whether skipping leaves a bug in place.
        _state.records[fix.id] = _Record(finding, f"skipped by {_switches.SKIP_VAR}", skipped=True)
        if finding.state == "broken":
            report(
                f"diffusers_cudnn_fix: '{fix.id}' ({fix.title}) is broken in the installed diffusers and "
                f"left unfixed because {_switches.SKIP_VAR} names it.",
                FixNotAppliedWarning,
            )
        return False
    if finding.state != "broken":
        reason = {
            "ok": f"not needed: {finding.detail}",
            "absent": f"not applicable: {finding.detail}",
            "unknown": f"left alone, behaviour unknown: {finding.detail}",
        }[finding.state]
        _state.records[fix.id] = _Record(finding, reason, seen=tuple(raw_get(module, t) for t in fix.targets))
        if finding.state == "unknown":
            report(
                f"diffusers_cudnn_fix: '{fix.id}' ({fix.title}) {reason}. Training with this backend under "
                "context parallelism may give wrong gradients; please report your diffusers version.",
                FixNotAppliedWarning,
            )
        return False
    try:
        replacements = dict(fix.build(lookup))
        verified = fix.check(lambda name: callable_of(replacements[name]) if name in replacements else lookup(name))
    except Exception as exc:  # noqa: BLE001 - a failing build leaves diffusers as shipped
        verified = Finding("unknown", f"building the replacement failed: {type(exc).__name__}: {exc}")
    if verified.state != "ok":
        reason = f"found broken, but the replacement did not pass the same check ({verified.detail})"
        _state.records[fix.id] = _Record(finding, reason)
        report(f"diffusers_cudnn_fix: '{fix.id}' NOT applied: {reason}.", FixNotAppliedWarning)
        return False
    for target, new in replacements.items():
        _state.originals.setdefault(target, raw_get(module, target))
        _raw_set(module, target, new)
        _state.installed[target] = new
        _state.owners.setdefault(target, []).append(fix.id)
    verb = "fixed" if fix.kind == "correction" else "guarded"
    _state.records[fix.id] = _Record(finding, f"{verb}: {finding.detail}", installed=True)
    return True


def _module_namespaces(skip: ModuleType) -> Iterator[tuple[str, dict[str, Any]]]:
    """Namespaces of diffusers' own modules and of the user's code: third-party packages are skipped."""
    for name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None) if mod is not None and mod is not skip else None
        if isinstance(namespace, dict) and _scanned_package(name.partition(".")[0]):
            yield name, namespace


def _scanned_package(top: str) -> bool:
    if top == "diffusers":
        return True
    if top in _SCAN_SKIP:
        return False
    namespace = getattr(sys.modules.get(top), "__dict__", None)
    # Read the namespace, not the attribute: a lazy module's __getattr__ must not run (it may import).
    path = (namespace.get("__file__") if isinstance(namespace, dict) else None) or ""
    return not ("site-packages" in path or "dist-packages" in path)


def _rebind_references(module: ModuleType) -> None:
    """Rebind module globals that still hold a shipped op (``from ... import _cudnn_..._op`` copies)."""
    # Module-level functions only: a class attribute's staticmethod object is never imported elsewhere.
    by_id = {id(orig): t for t, orig in _state.originals.items() if orig is not None and "." not in t}
    if not by_id:
        return
    for mod_name, namespace in _module_namespaces(module):
        for global_name, value in list(namespace.items()):
            target = by_id.get(id(value))
            if target is None or value is not _state.originals[target]:
                continue
            try:
                namespace[global_name] = _state.installed[target]
            except Exception:  # noqa: BLE001 - a read-only namespace: say so instead
                ref = f"{mod_name}.{global_name}"
                _state.stale.append(ref)
                report(
                    f"diffusers_cudnn_fix: {ref} holds the shipped {target} and could not be rebound; "
                    "calls through it still use the buggy op.",
                    StaleReferenceWarning,
                )
                continue
            _state.rebound.append((mod_name, global_name, value, _state.installed[target]))
            logger.info("rebound %s.%s to the corrected %s", mod_name, global_name, target)


def _announce(newly: list[str]) -> None:
    """Say once what was applied, where the release table and the check disagree, or that we are not needed."""
    version = _diffusers_version()
    for fix in _fixes():
        record = _state.records.get(fix.id)
        expected = _expected(fix, version)
        if record is None or expected is None or fix.id in _state.mismatches_reported:
            continue
        state = record.finding.state
        if state == "absent" and expected:
            message = f"carries '{fix.id}', but the functions it patches are not there (renamed?): nothing to fix"
        elif state in ("broken", "ok") and expected != (state == "broken"):
            message = (
                f"{'carries' if expected else 'does not carry'} '{fix.id}', but the installed code "
                f"{'does' if state == 'broken' else 'does not'}; acting on the code"
            )
        else:
            continue
        _state.mismatches_reported.add(fix.id)
        report(
            f"diffusers_cudnn_fix: the release table says diffusers {version} {message}.", ReleaseTableMismatchWarning
        )
    if newly:
        logger.info("diffusers_cudnn_fix: diffusers %s: applied %s", version, ", ".join(newly))
    if not _state.announced:
        corrections = [f for f in _fixes() if f.kind == "correction"]
        states = {f.id: _state.records[f.id].finding.state for f in corrections if f.id in _state.records}
        # A correction that matters only to some runs (only_for) is named as the condition instead.
        conditional = {f.id: f.only_for for f in corrections if f.only_for and states.get(f.id) == "broken"}
        rest = {i: s for i, s in states.items() if i not in conditional}
        if len(states) == len(corrections) and set(rest.values()) <= {"ok", "absent"}:
            module = _state.module
            guards = [f.id for f in _fixes() if f.kind == "guard" and module is not None and _applied(module, f)]
            logger.info(
                "diffusers_cudnn_fix: diffusers %s needs none of the gradient corrections (%s); the package can be "
                "removed for them.%s%s",
                version,
                ", ".join(rest),
                "".join(f" {i} is needed for {runs} only." for i, runs in conditional.items()),
                f" Guards still active: {', '.join(guards)}." if guards else "",
            )
    _state.announced = True


def revert() -> Report:
    """Put back exactly the objects that were there before us. Idempotent, thread-safe."""
    with _state.lock:
        module = _state.module
        if module is not None:
            for target, original in _state.originals.items():
                if _ours(module, target):
                    _raw_set(module, target, original)
                else:
                    logger.warning(
                        "%s.%s was changed by someone else since we patched it; left as is", MODULE_NAME, target
                    )
            for mod_name, global_name, original, ours in _state.rebound:
                namespace = getattr(sys.modules.get(mod_name), "__dict__", None)
                if isinstance(namespace, dict) and namespace.get(global_name) is ours:
                    namespace[global_name] = original
            _state.originals.clear()
            _state.installed.clear()
            _state.owners.clear()
            _state.rebound.clear()
            _state.stale.clear()
            for fix_id, record in list(_state.records.items()):
                _state.records[fix_id] = _Record(record.finding, "reverted by revert()", record.skipped)
        return status()


def original(target: str) -> Any:
    """The object at ``diffusers.models.attention_dispatch.<target>`` before we patched it.

    ``target`` is an attribute or ``Class.attribute`` path; a class attribute comes back as stored (a
    staticmethod stays one). Returns the live object when we did not patch it, so callers always get the
    shipped code.
    """
    module = sys.modules.get(MODULE_NAME)
    with _state.lock:
        if target in _state.originals:
            return _state.originals[target]
        return raw_get(module, target) if module is not None else None


def is_patched(target: str) -> bool:
    """Whether our object sits at ``diffusers.models.attention_dispatch.<target>`` right now."""
    module = sys.modules.get(MODULE_NAME)
    with _state.lock:
        return module is not None and _ours(module, target)


def status() -> Report:
    """A structured report of versions and of every fix's state (see :class:`Report`)."""
    from ._report import FixStatus, Report

    with _state.lock:
        enabled = _switches.enabled()
        module = sys.modules.get(MODULE_NAME)
        version = _diffusers_version()
        fixes = []
        for fix in _fixes():
            record = _state.records.get(fix.id) if module is not None and module is _state.module else None
            applied = module is not None and _applied(module, fix)
            if not enabled and not applied:
                detected, reason = "disabled", f"package switched off by {_switches.ENABLE_VAR}=0"
            elif record is None and module is not None:
                detected, reason = (
                    "unchecked",
                    "not checked: revert() disarmed the package before the import; call apply()",
                )
            elif record is None:
                detected, reason = "pending", f"{MODULE_NAME} not imported yet"
            else:
                detected, reason = record.finding.state, record.reason
            if record is not None and record.installed and not applied:
                reason = "was fixed, but the module no longer holds our replacement (reloaded?): call apply()"
            if applied and fix.note is not None:
                reason = f"{reason} [{fix.note()}]"
            fixes.append(
                FixStatus(
                    id=fix.id,
                    title=fix.title,
                    upstream=fix.upstream,
                    affected=fix.affected,
                    expected=_expected(fix, version),
                    detected=detected,
                    applied=applied,
                    reason=reason,
                )
            )
        torch_mod = sys.modules.get("torch")
        probes: tuple[Any, ...] = ()
        if fixes and torch_mod is not None:
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
