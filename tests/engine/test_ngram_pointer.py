"""Prompt lookup's copy pointer (engine.speculation.ngram): a long copy follows its source."""

from engine.speculation.ngram import NgramIndex

SOURCE = [5, 6, 7, 8, 9, 10, 11, 12]
FILE = list(range(20, 60))  # a file of 40 distinct tokens


def test_the_copy_follows_its_source_not_the_latest_occurrence_of_the_suffix():
    idx = NgramIndex(min_n=2, max_n=2)
    idx.extend(SOURCE + [6, 7, 0, 0, 3] + [5, 6])  # the source, other text reusing [6, 7], the copy begins
    assert idx.propose(3) == [7, 8, 9]  # from the source
    idx.extend([7])  # the target emitted what the source had
    assert idx.lookup(2) == [0, 0]  # the index alone: the latest [6, 7]
    assert idx.propose(2) == [8, 9]  # the pointer: where the copy was


def _copying(n: int) -> NgramIndex:
    """A file, a separator, and the first ``n`` tokens of its copy, emitted
    round by round as the pointer proposed them."""
    idx = NgramIndex(min_n=2, max_n=4)
    idx.extend(FILE + [1] + FILE[:2])
    while len(idx) - len(FILE) - 1 < n:
        drafts = idx.propose(4)
        assert drafts == FILE[len(idx) - len(FILE) - 1 :][:4]
        idx.extend(drafts)
    return idx


def test_after_an_edit_inside_a_long_copy_the_copy_resumes_one_token_later():
    idx = _copying(14)
    assert idx.propose(4) == FILE[14:18]
    idx.extend([99])  # the edit: the target wrote 99 where the file had FILE[14]
    assert idx.propose(2) == []  # nothing matches [.., 99]
    idx.extend([FILE[15]])  # the copy goes on after the changed token
    assert idx.lookup(2) == []  # the index needs two matching tokens: [99, FILE[15]] is nowhere
    assert idx.propose(3) == FILE[16:19]  # re-aligned just after where the source had got to


def test_a_chance_match_in_free_text_does_not_re_align():
    idx = NgramIndex(min_n=2, max_n=4)
    idx.extend(SOURCE + [1] + [5, 6])
    assert idx.propose(4) == [7, 8, 9, 10]  # a 2-gram match, no copy behind it
    idx.extend([99, 8])  # the text went elsewhere; 8 happens to be in the source
    assert idx.propose(2) == []


def test_a_token_far_from_the_pointer_does_not_realign_it():
    idx = _copying(14)
    idx.realign_window = 2
    assert idx.propose(2) == FILE[14:16]
    idx.extend([99, FILE[19]])  # FILE[19] is five tokens past where the source had got to
    assert idx.propose(2) == []


def test_a_copy_that_skips_ahead_resumes_after_its_source_not_at_the_latest_match():
    """The target copies a file but skips a stretch of it (SmolLM2 asked to
    return an edited file wrote the def lines and skipped the bodies): the
    copy resumes at the next occurrence of the suffix after where its source
    had got to, not at the most recent one (its own earlier output)."""
    a, b, c = [30, 31, 32], [40, 41, 42], [50, 51, 52]
    body = [60, 61, 62, 63, 64]
    src = [1, 2] + a + body + [1, 2] + b + body[::-1] + [1, 2] + c
    idx = NgramIndex(min_n=2, max_n=4)
    idx.extend(src + [9] + [1, 2] + a)  # the copy began: the first def line
    assert idx.propose(2) == body[:2]  # the pointer follows the source into the body
    idx.extend([1, 2])  # the target skipped the body and wrote the next def line
    assert idx.lookup(3) == a  # the index alone: the latest [1, 2] is the copy's own
    assert idx.propose(3) == b  # forward from where the source had got to
