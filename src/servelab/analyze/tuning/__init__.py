"""The tuning decision, pure: candidate settings, one decision, predicted against measured.

``catalogue`` defines each lever once (diagnosis recommendations read it too); ``shape`` says
which knobs the run's own traffic and settings call for; ``candidates`` turns levers and the
shape into settings to simulate; ``prediction`` holds figures per class and the replay's
self-check; ``decision`` chooses one setting; ``verification`` compares the prediction with a
real rerun; ``result`` is the record ``servelab tune`` fills.
"""
