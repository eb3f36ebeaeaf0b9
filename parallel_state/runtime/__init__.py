"""Layer 4, runtime: starting and describing a job.

``dist_init`` (``dist_init``), launcher detection (``launch``), ``DistributedManager``
(``manager``), rank / world size / collective device (``resolve``), DeviceMesh views for
DTensor and FSDP2 (``mesh``) and the print helpers (``log``).
"""
