"""The one answer to "what does this diffusers need from the package": ``apply``, ``keep`` or ``remove``.

Computed once, from what each fix's check found in the shipped code (:func:`decide`), and rendered by the one
sentence of :meth:`Advice.sentence`: the import-time INFO log, the doctor's text and its ``--json`` all say it, so
that no output can say otherwise. Plain data, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .fixes import ALL_FIXES

#: ``apply``: a correction is needed for every context-parallel run (or a check could not tell); ``keep``: no
#: correction is needed for most runs, but a bug is still open here (a guard, or a correction some runs need);
#: ``remove``: no bug of the package's is in the shipped code.
AdviceWord = Literal["apply", "keep", "remove"]

#: A check's states that leave nothing to do: the code is right, or the functions are not there.
QUIET = ("ok", "absent")


@dataclass(frozen=True)
class Advice:
    """What the installed release needs, by fix id, and the word that sums it up."""

    word: AdviceWord
    version: str | None
    corrections: tuple[str, ...] = ()  # corrections every context-parallel run needs (or a check was not sure)
    only_for: dict[str, str] = field(default_factory=dict)  # corrections some runs need: id -> those runs
    guards: tuple[str, ...] = ()  # guards whose bug is in the shipped code (or a check was not sure)

    @property
    def needed(self) -> tuple[str, ...]:
        """Every fix id this release needs, in the fix table's order."""
        wanted = {*self.corrections, *self.only_for, *self.guards}
        return tuple(fix.id for fix in ALL_FIXES if fix.id in wanted)

    def cases(self) -> list[str]:
        """The training runs that still meet a bug where only guards and corrections for some runs are left."""
        by_id = {fix.id: fix for fix in ALL_FIXES}
        runs = [by_id[i].matters_to or by_id[i].title for i in self.guards] + list(self.only_for.values())
        return list(dict.fromkeys(runs))

    def sentence(self) -> str:
        """The advice in one or two sentences: what the doctor says first and the import-time log says, each after
        the word itself (:meth:`line`). The sentence of ``apply`` never says "keep", nor that of ``keep`` "apply":
        one word, one meaning, wherever it is read."""
        release = f"diffusers {self.version or '(version unknown)'}"
        if self.word == "remove":
            return f"{release} needs none of this package's fixes: it changes nothing here and can be removed."
        if self.word == "apply":
            others = [*self.only_for, *self.guards]
            also = f", and has other bugs it handles ({', '.join(others)})" if others else ""
            return (
                f"{release} needs this package's gradient corrections ({', '.join(self.corrections)}) for "
                f"context-parallel training{also}: import it in every process of the training run."
            )
        *most, last = self.cases() or ["the cases the doctor lists"]
        uses = f"{', '.join(most)}, or {last}" if most else last
        return (
            f"{release} still has bugs the package handles ({', '.join(self.needed)}): keep it if your training "
            f"uses {uses}. For training that uses none of them it changes nothing, and removing it is safe."
        )

    def line(self) -> str:
        """The word and the sentence, as the doctor's first line and the import-time log say them."""
        return f"advice {self.word}: {self.sentence()}"

    def to_dict(self) -> dict[str, Any]:
        """The doctor's ``--json`` fields: ``advice``, ``advice_text`` and what it is made of."""
        return {
            "advice": self.word,
            "advice_text": self.sentence(),
            "needs": {
                "corrections": list(self.corrections),
                "only_for": dict(self.only_for),
                "guards": list(self.guards),
            },
        }


def decide(shipped: Mapping[str, str], version: str | None) -> Advice:
    """The advice from what each fix's check found in the shipped code (``shipped``: fix id -> state).

    A fix found ``unknown`` counts as needed: the package cannot rule its bug out. A correction that matters only
    to some runs on this release (:attr:`Fix.only_for`) and is found broken is named with those runs instead.
    """
    fixes = [fix for fix in ALL_FIXES if fix.id in shipped]
    needed = [fix for fix in fixes if shipped[fix.id] not in QUIET]
    only_for = {f.id: f.only_for for f in needed if f.kind == "correction" and f.only_for and shipped[f.id] == "broken"}
    corrections = tuple(f.id for f in needed if f.kind == "correction" and f.id not in only_for)
    guards = tuple(f.id for f in needed if f.kind == "guard")
    word: AdviceWord = "apply" if corrections else ("keep" if needed else "remove")
    return Advice(word, version, corrections, only_for, guards)
