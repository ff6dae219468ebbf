"""TLS for the scheduler's gRPC channel: PEM files named by ``TFPSX_TLS_*``."""

from __future__ import annotations

import dataclasses
import os
from typing import Mapping, Optional

import grpc

from tfpsx import settings

_FIELDS = {"cert": "TFPSX_TLS_CERT", "key": "TFPSX_TLS_KEY", "ca": "TFPSX_TLS_CA"}


@dataclasses.dataclass
class TlsConfig:
    """PEM files for TLS: the scheduler needs cert+key, clients the CA (and may add cert+key)."""
    cert: Optional[str] = None
    key: Optional[str] = None
    ca: Optional[str] = None

    @classmethod
    def from_env(cls, env: Optional[Mapping[str, str]] = None) -> Optional["TlsConfig"]:
        """The files ``TFPSX_TLS_CERT/KEY/CA`` name, or None when none is set.

        Raises:
          ValueError: a named file does not exist, or only one of cert and key is set.
        """
        values = {f: settings.raw(name, env) for f, name in _FIELDS.items()}
        if not any(values.values()):
            return None
        for field, path in values.items():
            if path and not os.path.isfile(path):
                raise ValueError(f"{_FIELDS[field]}: file {path!r} does not exist; "
                                 "expected a PEM file")
        if bool(values["cert"]) != bool(values["key"]):
            raise ValueError("TFPSX_TLS_CERT and TFPSX_TLS_KEY go together; got only "
                             f"{'TFPSX_TLS_CERT' if values['cert'] else 'TFPSX_TLS_KEY'}")
        return cls(**values)

    @staticmethod
    def _read(path):
        with open(path, "rb") as f:
            return f.read()

    def server_credentials(self):
        if not (self.cert and self.key):
            raise ValueError("the scheduler needs TFPSX_TLS_CERT and TFPSX_TLS_KEY to serve TLS")
        root = self._read(self.ca) if self.ca else None
        return grpc.ssl_server_credentials([(self._read(self.key), self._read(self.cert))],
                                           root_certificates=root)

    def channel_credentials(self):
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca) if self.ca else None,
            private_key=self._read(self.key) if self.key else None,
            certificate_chain=self._read(self.cert) if self.cert else None)
