"""The grammar speculator's walk over forced text (engine/speculators/grammar.py), on a character stand-in."""

import numpy as np

from specray.engine.speculator import DraftRequest
from specray.engine.speculators.grammar import GrammarSpeculator, _Regex, forced_walk

PROBE = tuple('{}":, abcdefghijklmnopqrstuvwxyz0123456789')


def test_forced_text_follows_the_json_habit_and_the_sequences_own():
    # no habit yet: JSON's (a space after ':' and ','), none after '{'
    assert forced_walk(_Regex('{"id": 1'), PROBE, {}, None, 64) == '{"id": 1'
    # this sequence wrote '{ ' before: it gets the space there, and none after ':' when that is its habit
    assert forced_walk(_Regex('{"id":1'), PROBE, {"{": " ", ":": ""}, None, 64) == '{ "id":1'
    assert forced_walk(_Regex('{"id": 1'), PROBE, {}, None, 5) == '{"id"'  # max_chars


class _Choice(_Regex):
    """Allows two characters after 'ab': where the grammar leaves a choice, the walk stops."""

    def allowed(self, cs):
        if self.i == 2:
            return np.array([c in "xy" for c in cs])
        return super().allowed(cs)


def test_the_walk_stops_at_a_real_choice():
    assert forced_walk(_Choice("abxyz"), PROBE, {}, None, 64) == "ab"


def test_without_a_vocabulary_it_drafts_nothing():
    spec = GrammarSpeculator()
    spec.set_grammar(0, 'root ::= "a"')
    spec.begin(0, np.array([1, 2, 3], dtype=np.int32))
    assert spec.draft([DraftRequest(0, np.array([1, 2, 3], dtype=np.int32), 8)])[0].tolist() == []
