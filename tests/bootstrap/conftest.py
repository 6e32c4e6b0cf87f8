"""Real-sshd fixtures for the bootstrap tests (see tests/support/sshd.py)."""

from support.sshd import ssh_key, sshd_factory

__all__ = ["ssh_key", "sshd_factory"]
