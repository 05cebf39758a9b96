"""Models fitted to measured runs: a run as it ran, a calibration, a twin of another server.

``recorded_steps`` rebuilds each recorded step's work; ``run_profile`` makes a profile of a
run's steps; ``calibrate`` fits the roofline's efficiencies; ``twin`` fits another server's
step cost to its client timestamps; ``asrun`` replays a run's own requests on its own model.
"""
