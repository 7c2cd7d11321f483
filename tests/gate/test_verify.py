"""``packfree verify`` compares each packed sample with that sample alone, not only the leak audit."""

from __future__ import annotations

from packfree_plugin.cli.main import main
from packfree_plugin.cli.verify import verify


def test_verify_fails_a_model_that_is_wrong_without_leaking(capsys, roberta_without_positions) -> None:
    """RoBERTa's shifted positions move no sample into another: the leak audit passes, the alone check fails."""
    mine, _ = verify("roberta", reference="")
    assert not mine.leaks and mine.alone is not None and not mine.alone.exact and not mine.ok
    assert main(["verify", "roberta", "--no-reference"]) == 1
    out = capsys.readouterr().out
    assert "no leak" in out and "differ from each sample alone" in out and "position_embeddings" in out
    assert "WRONG: packed samples differ" in out


def test_verify_passes_an_exact_model_on_both_checks() -> None:
    mine, stock = verify("llama")
    assert mine.ok and mine.alone.exact and stock is not None
    assert mine.numbering == "from 0"


def test_verify_says_how_the_model_numbers_positions(capsys) -> None:
    """RoBERTa numbers a lone sample from ``padding_idx + 1``: verify says so (the proof and the audit pack 0-based ids
    on purpose and stay silent about it), beside a model that takes no position ids."""
    import warnings

    from packfree_plugin.quirks.numbering import PositionNumberingWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", PositionNumberingWarning)
        assert main(["verify", "roberta", "--no-reference"]) == 0
    out = capsys.readouterr().out
    assert "positions of a lone sample: from padding_idx + 1 = 2 (roberta.embeddings: RobertaEmbeddings)" in out
    mine, _ = verify("mamba2", reference="")
    assert mine.numbering.startswith("not by ids")


def test_verify_runs_an_encoder_decoder_on_both_sides(record_property) -> None:
    """T5 makes no decoder inputs of its own: the audit gives its decoder the packed samples too (as the load-time
    proof does; before, ``packfree verify t5`` crashed before auditing). packfree does not leak them; whether stock
    sdpa does is a fact of the release (it leaked on 5.20 - 5.25), recorded, not asserted."""
    mine, stock = verify("t5")
    assert mine.ok and mine.alone.exact and not mine.leaks
    assert stock is not None, "verify ran no stock reference"
    record_property("stock sdpa, T5 packed: leaks", stock.leaks)
