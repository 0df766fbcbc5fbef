"""Side by side with the servers a team would pick instead (``make bench-peers``: ``bench/peers/run.py``)."""
