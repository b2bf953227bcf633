"""Figure text in Traditional Chinese with a CJK font (the zh-tw extra), English otherwise."""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from attnlab.explain import fonts
from attnlab.explain.figures import plot_attention_flow, plot_heatmap, save_walkthrough_figures
from attnlab.explain.model_trace import ModelTrace
from attnlab.explain.trace import trace_example
from cli_runner import run_main


def small_trace() -> ModelTrace:
    w = torch.softmax(torch.randn(1, 1, 4, 4), -1)
    return ModelTrace(tokens=("我", "們", "的", "路"), key_tokens=("我", "們", "的", "路"),
                      layers=(0,), heads=(0,), num_layers=1, num_heads=1, weights=w)  # fmt: skip


def rendered_warnings(fig) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fig.savefig(io.BytesIO(), format="png")
    return [str(w.message) for w in caught]


def test_chinese_figure_text_renders_with_the_cjk_font():
    pytest.importorskip("pylopdf_fonts_zh_tw", reason="pip install 'attnlab[zh-tw]'")
    fig = plot_heatmap(small_trace(), 0, 0, lang="zh-TW")
    ax = fig.axes[0]
    assert ax.get_xlabel() == "鍵（被注意的詞元）" and ax.get_ylabel() == "查詢（發出注意的詞元）"
    assert ax.get_title(loc="left") == "第 0 層、第 0 個頭"
    assert ax.xaxis.label.get_fontfamily()[0] == fonts.figure_font()
    assert not [w for w in rendered_warnings(fig) if "missing from font" in w]
    flow = plot_attention_flow(trace_example("journey"), lang="zh-TW")
    texts = [t.get_text() for t in flow.axes[0].texts]
    assert "輸入 X" in texts and "權重 A" in texts
    assert flow.axes[0].get_title(loc="left").startswith("縮放點積自注意力")
    assert not [w for w in rendered_warnings(flow) if "missing from font" in w]


def test_without_a_cjk_font_figures_fall_back_to_english(monkeypatch):
    monkeypatch.setattr(fonts, "figure_font", lambda: None)
    fl = fonts.figure_lang("zh-TW")
    assert fl.lang == "en" and "pip install 'attnlab[zh-tw]'" in (fl.notice or "")
    fig = plot_heatmap(small_trace(), 0, 0, lang="zh-TW")
    assert fig.axes[0].get_xlabel() == "key (token attended to)"
    # DejaVu has no CJK glyphs: the English labels are what keeps the figure readable.
    assert fonts.figure_lang("en").notice is None


def test_english_is_unchanged_by_the_font():
    fig = plot_heatmap(small_trace(), 0, 0)
    assert fig.axes[0].get_xlabel() == "key (token attended to)"
    assert fig.axes[0].xaxis.label.get_fontfamily() != [fonts.figure_font()]


def test_walkthrough_says_so_in_one_line_when_it_falls_back(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(fonts, "figure_font", lambda: None)
    code, out, err = run_main(capsys, "walkthrough", "--lang", "zh-TW", "--out", str(tmp_path))
    assert code == 0 and "注意力權重" in out
    assert err.strip() == fonts.NOTICE
    assert (tmp_path / "attention-flow.png").exists()


def test_save_walkthrough_figures_in_chinese(tmp_path):
    pytest.importorskip("pylopdf_fonts_zh_tw", reason="pip install 'attnlab[zh-tw]'")
    paths = save_walkthrough_figures(trace_example("journey"), tmp_path, lang="zh-TW")
    assert len(paths) == 6 and all(p.stat().st_size > 1000 for p in paths)
    # matplotlib's SVG draws text as glyph outlines: each text's string is kept in a comment
    # before its glyphs, and each glyph is defined under an id that starts with its font's
    # name. The Chinese titles must be there, drawn with the CJK font's glyphs.
    cjk_glyph = 'id="' + fonts.figure_font().replace(" ", "")  # "Noto Sans TC" -> NotoSansTC
    titles = {
        "attention-weights-simplified": "<!-- 簡化的注意力權重：softmax(X·Xᵀ, dim=-1) -->",
        "attention-weights-trainable": "<!-- 具可訓練權重的注意力權重：softmax(Q·Kᵀ / √d_k",
        "attention-flow": "<!-- 縮放點積自注意力：範例「journey」",
    }
    for stem, title in titles.items():
        svg = (tmp_path / f"{stem}.svg").read_text(encoding="utf-8")
        assert title in svg, stem
        assert "<!-- 鍵" in svg or "<!-- 輸入 X -->" in svg, stem  # axis / box labels too
        assert cjk_glyph in svg, stem
    # Positive control: the English figures hold none of it.
    en = save_walkthrough_figures(trace_example("journey"), tmp_path / "en", lang="en")
    svg = en[1].read_text(encoding="utf-8")
    assert "簡化" not in svg and cjk_glyph not in svg
