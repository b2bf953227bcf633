"""A CJK font for figure text in Traditional Chinese, when one is available.

Matplotlib's bundled DejaVu fonts have no CJK glyphs. :func:`figure_font` looks for, in
order: Noto Sans TC from the ``zh-tw`` extra (``pip install 'attnlab[zh-tw]'``, the
``pylopdf-fonts-zh-tw`` package, SIL Open Font License 1.1), then any installed font
matplotlib knows whose name says it covers Traditional Chinese. Without one, figures
stay in English and :func:`figure_lang` says so in one line.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FigureLang", "cjk_font_file", "figure_font", "figure_lang"]

# Installed families known to cover Traditional Chinese, best first.
_KNOWN = (
    "Noto Sans TC",
    "Noto Sans CJK TC",
    "Source Han Sans TC",
    "Noto Sans CJK JP",
    "Noto Sans CJK SC",
    "WenQuanYi Zen Hei",
    "AR PL UMing TW",
    "Microsoft JhengHei",
    "PingFang TC",
)
NOTICE = "figure text in English: no CJK font found (pip install 'attnlab[zh-tw]' for Noto Sans TC)"


@dataclass(frozen=True)
class FigureLang:
    """The language figures are drawn in, the font family for it, and a notice.

    Attributes:
        lang: ``"en"`` or ``"zh-TW"`` (zh-TW only with a CJK font).
        family: the font family to draw with, or None for matplotlib's default.
        notice: one line for the user when the asked language fell back, else None.
    """

    lang: str
    family: str | None = None
    notice: str | None = None


def cjk_font_file() -> Path | None:
    """The Noto Sans TC file of the ``zh-tw`` extra, or None when it is not installed."""
    try:
        import pylopdf_fonts_zh_tw
    except ImportError:
        return None
    path = Path(pylopdf_fonts_zh_tw.sans_path())
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1)
def figure_font() -> str | None:
    """The family name of a font with Traditional Chinese glyphs, registered with
    matplotlib, or None."""
    from matplotlib import font_manager

    path = cjk_font_file()
    if path is not None:
        try:
            font_manager.fontManager.addfont(str(path))
            return str(font_manager.FontProperties(fname=str(path)).get_name())
        except (OSError, RuntimeError):
            pass
    names = {f.name for f in font_manager.fontManager.ttflist}
    return next((n for n in _KNOWN if n in names), None)


def figure_lang(lang: str) -> FigureLang:
    """The figure language for ``lang``: zh-TW with a CJK font, else English (with a
    notice when zh-TW was asked for)."""
    from attnlab.explain.i18n import normalize_lang

    lang = normalize_lang(lang)
    if lang == "en":
        return FigureLang("en")
    family = figure_font()
    if family is None:
        return FigureLang("en", None, NOTICE)
    return FigureLang(lang, family)
