"""The one advice (``_advice.decide``: apply / keep / remove), searched over every combination of check states.

The doctor's text, its ``--json`` and the import-time log render this one value (tests/test_import_safety.py,
``test_one_advice_in_the_log_the_doctor_text_and_its_json``); here the value itself is held to its definition
(docs/doctor.md, "The advice"), for states the releases never show together too.
"""

from __future__ import annotations

import sys
import types

from hypothesis import given, settings
from hypothesis import strategies as st

from diffusers_cudnn_fix._advice import QUIET, decide
from diffusers_cudnn_fix.fixes import ALL_FIXES

STATES = ("broken", "ok", "absent", "unknown")


@settings(max_examples=300, deadline=None)
@given(
    states=st.fixed_dictionaries({fix.id: st.sampled_from(STATES) for fix in ALL_FIXES}),
    version=st.sampled_from(["0.36.0", "0.39.0", "0.40.0", "0.42.1", "0.43.0.dev0", None]),
)
def test_the_advice_follows_its_definition(states: dict[str, str], version: str | None) -> None:
    saved = sys.modules.get("diffusers")
    sys.modules["diffusers"] = types.SimpleNamespace(__version__=version)  # what Fix.only_for reads
    try:
        advice = decide(states, version)
        only_for = {fix.id: fix.only_for for fix in ALL_FIXES if fix.only_for}
    finally:
        if saved is None:
            sys.modules.pop("diffusers", None)
        else:
            sys.modules["diffusers"] = saved
    needed = [fix for fix in ALL_FIXES if states[fix.id] not in QUIET]
    # A correction every run needs: found broken (and not one for some runs only on this release), or unknown.
    everyone = [
        fix.id for fix in needed if fix.kind == "correction" and (states[fix.id] == "unknown" or fix.id not in only_for)
    ]
    assert advice.needed == tuple(fix.id for fix in needed)
    assert advice.corrections == tuple(everyone)
    assert advice.word == ("apply" if everyone else "keep" if needed else "remove")
    sentence = advice.sentence()
    for fix in needed:  # every fix still needed is named where the advice is said
        assert fix.id in sentence, (fix.id, sentence)
    if advice.word == "remove":
        assert "can be removed" in sentence and not any(fix.id in sentence for fix in ALL_FIXES)
    else:
        assert "can be removed" not in sentence
    # One word, one meaning (#49): the sentence of "apply" says how to apply it and never "keep"; that of "keep"
    # says when to keep it.
    if advice.word == "apply":
        assert "import it in every process" in sentence and "keep" not in sentence, sentence
    if advice.word == "keep":
        assert "keep it if" in sentence and "apply" not in sentence, sentence
    if advice.word == "keep":  # the runs that still meet a bug are named
        for fix in needed:
            runs = advice.only_for.get(fix.id) or fix.matters_to or fix.title
            assert runs in sentence, (runs, sentence)
    assert advice.to_dict()["advice_text"] == sentence and advice.to_dict()["advice"] == advice.word
