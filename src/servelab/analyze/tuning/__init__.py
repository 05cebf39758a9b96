"""The tuning decision, pure: candidate settings, one decision, predicted against measured.

``candidates`` turns levers into settings to simulate; ``prediction`` holds figures per class
and the replay's self-check; ``decision`` chooses one setting; ``verification`` compares the
prediction with a real rerun; ``result`` is the record ``servelab tune`` fills.
"""
