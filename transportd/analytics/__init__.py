"""Tracking-log analytics: a PySpark job over the MSGTRK logs of many nodes (``transportd analyze``).

``schema`` holds the field lists (taken from ``transportd.tracking``) and the event classes the
job reasons with; ``job`` is the Spark job (DataFrame API only, no row-level data collected to
the driver); ``generate`` writes realistic multi-node logs with injected failures and the truth
beside them; ``report`` renders the self-contained HTML page. Nothing here is imported by the
daemon, and pyspark is imported only inside ``job``.
"""
