"""The fix record (torch-free), what a behavioural check returns, and the release table's reader."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from . import _explain

#: What a check can say about the installed code.
#: ``broken``: the bug is there; ``ok``: the installed code does the right thing; ``absent``: the functions
#: do not exist (release without the feature); ``unknown``: unexpected signature or behaviour, left alone.
State = Literal["broken", "ok", "absent", "unknown"]


class Lookup(Protocol):
    """An attribute of diffusers' attention module (``"Class.attr"`` too) as the check should see it: the
    shipped object, or the replacement being verified; None if missing. The registry's lookups also carry
    ``shipped(name)``, what diffusers shipped (:func:`shipped_of` reads it), and ``built(name, around, **seams)``
    (:func:`built_of` calls it)."""

    def __call__(self, name: str, /) -> Any: ...


def shipped_of(lookup: Lookup, name: str) -> Any:
    """What diffusers shipped at ``name``, for a check that must run diffusers' own code under a replacement."""
    return getattr(lookup, "shipped", lookup)(name)


def built_of(lookup: Lookup, name: str, around: Any, **seams: Any) -> Any:
    """What a check runs at ``name`` with its own collaborators: ``around`` in place of diffusers' function there (a
    copy of it with stand-in collectives, or a stand-in that stops the call) and ``seams`` (collaborators a
    replacement's builder takes: the collectives, the ops it drives). Where ``lookup`` shows diffusers' own code
    there, that is ``around`` itself; where it shows a replacement, the same replacement built again by its builder
    from these collaborators (the registry's ``built``). A lookup without ``built`` (a plain function) can only show
    diffusers' own code: ``around``."""
    rebuild = getattr(lookup, "built", None)
    return around if rebuild is None else rebuild(name, around, **seams)


@dataclass(frozen=True)
class Finding:
    """What a check says: a state and one sentence of evidence; ``read``: facts the check read off the code on its
    way, which the builders would otherwise read again (``targets.Facts``; not part of the finding's identity);
    ``by_environment``: the state is this process's, not the code's alone (a fix whose bug needs a condition of
    the environment, :attr:`Fix.environment`, found ``ok`` because the condition does not hold here)."""

    state: State
    detail: str
    read: Mapping[str, Any] = field(default_factory=dict, compare=False)
    by_environment: bool = False


@dataclass(frozen=True)
class Fix:
    """One upstream bug and how this package handles it: plain data, no torch.

    Its check lives in ``fixes/<id>.py`` (``check(lookup) -> Finding``, run on the shipped code, and on the
    replacements before they are installed); its policy is one step of the replacement of each target
    (``targets/``), taken where the check finds the bug. docs/adding-a-fix.md lists what a new fix needs.

    Attributes:
        id: short stable name, used by ``DIFFUSERS_CUDNN_FIX_SKIP`` and in ``status()``.
        title: one line saying what goes wrong.
        upstream: where upstream tracks or fixed it.
        affected: PEP 440 specifier of the releases known to carry the bug (the release table); it sets
            expectations only, the check decides.
        targets: attributes of ``diffusers.models.attention_dispatch`` whose replacement takes its policy.
        kind: ``"correction"`` (makes wrong gradients right) or ``"guard"`` (stops, warns or converts where
            diffusers would compute wrong results and no correction is offered).
        note: optional; a few words on the fix's live settings for the report (a mode, say).
        only_for_on: for a correction that matters only to some context-parallel runs on some releases,
            (releases, runs): a PEP 440 specifier and those runs in a few words (:attr:`only_for`).
        old_ids: ids of fixes merged into this one, still accepted by ``DIFFUSERS_CUDNN_FIX_SKIP``.
        upstream_issue: where the source tree has ``upstream/<id>/`` (ISSUE.md, reproducer, fix.patch, test: a
            bug still open on the newest release), what that folder proposes, in a few words, for the doctor's
            pointer to it; None where it has none.
        matters_to: for a guard, the training runs that meet its bug, in a training run's words ("attention
            masks"): the doctor's and the log's condition for removing the package where only guards are left.
        reached_by: the ``verify`` run that reaches its policy (options, and the device where the backend's kernel
            needs one), for verify's advice where a run left it unexercised.
        bug_in: the targets whose shipped functions carry the bug, where they are not all of ``targets`` (a policy
            may act earlier on the path than the bug lies): what ``verify --without-package`` watches.
        reached_when: what makes a call of those shipped functions meet the bug, as far as ``verify
            --without-package`` can see: any call, a call with an attention mask, or nothing it looks at
            (``never``: a dtype, an alignment, a mask that requires grad; such a fix is never counted as reached).
        environment: where the bug needs more than diffusers' code, the condition of the process it needs, in a
            few words ("transformers not imported"): ``affected`` lists the releases whose code carries it, and
            the check finds it only where the condition holds (elsewhere ``ok``, ``Finding.by_environment``:
            no release-table mismatch, and the doctor says why it is not needed there).
    """

    id: str
    title: str
    upstream: str
    affected: str
    targets: tuple[str, ...]
    kind: Literal["correction", "guard"] = "correction"
    note: Callable[[], str] | None = None
    only_for_on: tuple[str, str] | None = None
    old_ids: tuple[str, ...] = ()
    upstream_issue: str | None = None
    matters_to: str = ""
    reached_by: str = ""
    bug_in: tuple[str, ...] = ()
    reached_when: Literal["call", "mask", "never"] = "call"
    environment: str = ""

    @property
    def only_for(self) -> str:
        """The runs this correction matters to where the imported diffusers is one of the releases of
        :attr:`only_for_on`, else "": where it is the only correction needed, the doctor and the log still say
        the package can be removed, for every other run. A dev build or no diffusers: "" (every run)."""
        if self.only_for_on is None:
            return ""
        releases, runs = self.only_for_on
        version = getattr(sys.modules.get("diffusers"), "__version__", None)
        return runs if release_table_lists(releases, None if version is None else str(version)) else ""

    @property
    def upstream_folder(self) -> str | None:
        """``upstream/<id>/ISSUE.md`` (in the source tree, not the wheel) where the fix has one, else None; None
        too outside the releases of :attr:`only_for_on`, where the bug it corrects is another, fixed upstream."""
        if self.upstream_issue is None or (self.only_for_on is not None and not self.only_for):
            return None
        return f"upstream/{self.id}/ISSUE.md"

    @property
    def upstream_command(self) -> str | None:
        """The command that prints the upstream report (ISSUE.md and fix.patch, from the files installed with the
        package: a wheel has no source tree) where :attr:`upstream_folder` names one, else None."""
        return None if self.upstream_folder is None else _explain.upstream_command(self.id)


def release_table_lists(specifier: str, version: str | None) -> bool | None:
    """Whether the release-table ``specifier`` (:attr:`Fix.affected`) admits ``version``.

    None for a pre-release or dev build (``0.40.0.dev0``): the table lists releases, and such a build can
    carry either code, which is exactly what the behavioural check is for; None too for a string that is
    not PEP 440, or for no version at all (diffusers not imported).
    """
    try:
        parsed = Version(version or "")  # "" (no version) is no PEP 440 version either
    except InvalidVersion:
        return None
    return None if parsed.is_prerelease else SpecifierSet(specifier).contains(parsed)
