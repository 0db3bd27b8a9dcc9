"""Fault injection with a total-queue checker: ``transportd chaos``.

proxy.py (a loopback fault proxy on the peer links), workload.py (real SMTP
clients recording every attempt), nemesis.py (a seeded fault schedule, one
fault at a time), preconditions.py (what a fault waits for, and when it is not
done), disk.py (data directories on a tmpfs, filled and freed), checker.py (lost / unexpected / duplicates / recovered) and
harness.py (one run: cluster up, faults, heal, drain, check, JSON summary).
"""
