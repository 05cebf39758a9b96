"""Why a percentile is what it is: attribution per request, findings, the diagnosis.

``attribution`` splits each TTFT and ITL stall into causes; ``findings`` names the causes the
data supports; ``diagnose`` joins them with the levers; ``timesplit`` splits a demo answer's
figure into parts that add up.
"""
