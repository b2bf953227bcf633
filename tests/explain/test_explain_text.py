"""attnlab.explain.text and attnlab.explain.i18n: the terminal walkthrough."""

from __future__ import annotations

import io
import re
import string

import pytest
import torch
from rich.cells import cell_len
from rich.console import Console

from attnlab.explain.i18n import LANGS, MESSAGES, message, normalize_lang
from attnlab.explain.text import format_number, matrix_table, walkthrough_renderables, wrap_text
from attnlab.explain.trace import trace_example


def _render(renderables, width: int = 100) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None)
    for r in renderables:
        console.print(r)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def journey():
    return trace_example("journey")


def test_every_message_exists_in_every_language_with_the_same_fields():
    for key, by_lang in MESSAGES.items():
        assert set(by_lang) == set(LANGS), key
        fields = {
            lang: {f for _, f, _, _ in string.Formatter().parse(text) if f}
            for lang, text in by_lang.items()
        }
        assert fields["en"] == fields["zh-TW"], key


def test_chinese_messages_are_chinese():
    cjk = re.compile(r"[\u4e00-\u9fff]")
    for key, by_lang in MESSAGES.items():
        if key.startswith("label.") and by_lang["en"] == by_lang["zh-TW"]:
            continue
        if key.endswith(".title") and not cjk.search(by_lang["en"]) and "=" in by_lang["en"]:
            continue  # formula titles such as attn_score_22 = query_2 · key_2
        assert cjk.search(by_lang["zh-TW"]), key


def test_normalize_lang():
    assert normalize_lang("zh_tw") == "zh-TW"
    assert normalize_lang("EN") == "en"
    with pytest.raises(ValueError, match="`lang` must be one of en, zh-TW; got 'fr'"):
        normalize_lang("fr")
    with pytest.raises(TypeError, match="`lang`"):
        normalize_lang(None)  # type: ignore[arg-type]
    assert "1.4142" in message("token_weights.text", "zh-TW", sqrt_dk=2**0.5)


def test_wrap_text_breaks_cjk_and_keeps_words_whole():
    text = (
        "在 softmax 之前先把分數除以 √d_k = 1.4142。"
        "點積會隨維度增大；分數過大時 softmax 會趨近 one-hot"
    )
    for width in (20, 33, 50):
        lines = wrap_text(text, width)
        assert all(cell_len(line) <= width for line in lines)
        assert "".join(lines).replace(" ", "") == text.replace(" ", "")
        assert all(not line.startswith(("，", "。", "；")) for line in lines)
        words = " ".join(lines).split()
        assert "softmax" in words and "one-hot" in words
    assert wrap_text("the quick brown fox", 9) == ["the quick", "brown fox"]


def test_matrix_table_formats_four_decimals():
    text = _render([matrix_table("t", torch.tensor([[1.0, 0.123456]]), row_labels=["a"])])
    assert "1.0000" in text and "0.1235" in text


def test_walkthrough_shows_every_step_with_computed_numbers(journey):
    text = _render(walkthrough_renderables(journey, "en"))
    s, tt = journey.simplified, journey.trainable_token
    # the numbers shown are the trace's, to 4 decimals
    for value in (s.weights[0, 0], s.context[5, 2], tt.query[1], tt.weights[4], tt.context[1]):
        assert format_number(float(value)) in text
    assert f"attn_score_22 = {format_number(tt.score_self)}" in text
    for label in ("attn_scores", "attn_weights", "row sum", "all_context_vecs", "query_2",
                  "keys", "attn_scores_2", "attn_weights_2", "context_vec_2",
                  "SelfAttentionV1", "SelfAttentionV2", "torch.manual_seed(123)",
                  "torch.manual_seed(789)", "dim=-1", "√d_k"):  # fmt: skip
        assert label in text, label
    assert "0.2098" in text and "0.4421" in text and "-0.0739" in text


def test_walkthrough_in_traditional_chinese(journey):
    en = _render(walkthrough_renderables(journey, "en"))
    zh = _render(walkthrough_renderables(journey, "zh-TW"))
    assert "注意力權重" in zh and "上下文向量" in zh and "列總和" in zh
    assert "Attention weights" not in zh
    numbers = re.compile(r"-?\d+\.\d{4}\b")
    assert numbers.findall(zh) == numbers.findall(en)  # same numbers, translated words


def test_walkthrough_toy_shows_the_transposed_convention():
    text = _render(walkthrough_renderables(trace_example("toy"), "en"))
    assert "x_2 @ W_query.T" in text
    assert "nn.Linear convention" in text
