"""Explain attention: traces of what was computed, as text, figures and a web page."""
