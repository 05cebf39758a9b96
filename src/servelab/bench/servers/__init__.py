"""The server under test: the embedded one launched, a template launched, or a URL probed.

``target`` launches ``servelab serve`` or probes a URL; ``template`` launches another server
from a command template; ``collect`` gathers server-side data while a run goes on.
"""
