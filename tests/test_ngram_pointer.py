"""Prompt lookup's copy pointer (engine.ngram): a long copy follows its source."""

from engine.ngram import NgramIndex

SOURCE = [5, 6, 7, 8, 9, 10, 11, 12]


def test_the_copy_follows_its_source_not_the_latest_occurrence_of_the_suffix():
    idx = NgramIndex(min_n=2, max_n=2)
    idx.extend(SOURCE + [6, 7, 0, 0, 3] + [5, 6])  # the source, other text reusing [6, 7], the copy begins
    assert idx.propose(3) == [7, 8, 9]  # from the source
    idx.extend([7])  # the target emitted what the source had
    assert idx.lookup(2) == [0, 0]  # the index alone: the latest [6, 7]
    assert idx.propose(2) == [8, 9]  # the pointer: where the copy was


def test_after_an_edit_the_copy_resumes_one_token_later():
    idx = NgramIndex(min_n=2, max_n=4)
    idx.extend(SOURCE + [1] + [5, 6])
    assert idx.propose(4) == [7, 8, 9, 10]
    idx.extend([99])  # the edit: the target wrote 99 where the source had 7
    assert idx.propose(2) == []  # nothing matches [6, 99] or [99]
    idx.extend([8])  # the copy goes on after the changed token
    assert idx.lookup(2) == []  # the index needs two matching tokens: [99, 8] is nowhere
    assert idx.propose(3) == [9, 10, 11]  # re-aligned on 8 just after where the source had got to


def test_a_token_far_from_the_pointer_does_not_realign_it():
    idx = NgramIndex(min_n=2, max_n=4)
    idx.realign_window = 2
    idx.extend(SOURCE + [1] + [5, 6])
    assert idx.propose(2) == [7, 8]
    idx.extend([99, 11])  # 11 is four tokens past where the source had got to
    assert idx.propose(2) == []
