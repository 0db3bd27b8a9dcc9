"""transportd: an SMTP transport daemon with Exchange-style shadow redundancy and Safety Net."""

__version__ = "0.1.0"
