"""The client: one planned request sent over HTTP, timed byte by byte, and its record.

``http`` timestamps bytes on arrival; ``send`` builds a ``ClientRecord``; ``recount``,
``usagecheck``, ``serverfigures`` and ``servertok`` read what the server said; ``requestid``
tags every request; ``monitor`` and ``event_loop`` keep the client honest about itself.
"""
