"""Reliability and security suite (issue 6): kills, timeouts, bad input, hostile bytes, soak, small shm."""
