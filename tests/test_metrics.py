"""WER / CER counting."""

from ddptrain.metrics import char_errors, edit_distance, word_errors


def test_edit_distance():
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance([], ["a"]) == 1
    assert edit_distance(["a", "b"], ["a", "b"]) == 0


def test_corpus_wer_is_not_mean_of_means():
    refs = ["one two three four", "five"]
    hyps = ["one two three four", "six"]
    errs, words = word_errors(refs, hyps)
    assert (errs, words) == (1, 5)  # 20 % corpus WER; the mean of per-utterance WERs would be 50 %


def test_cer_counts_spaces_and_collapses_runs():
    assert char_errors(["a b"], ["a  b"]) == (0, 3)
    assert char_errors(["ab"], ["a b"]) == (1, 2)
