"""What the server did, seen from outside: its settings, steps, /metrics series and costs.

``serversettings`` reads another server's scheduler settings; ``stepinfer`` infers a black-box
server's steps from stream timestamps; ``promscrape`` and ``timeseries`` read ``/metrics``;
``phase_costs`` prices speculation and disaggregation from the server's timelines.
"""
