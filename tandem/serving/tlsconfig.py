"""A service's TLS identity as files: the typed setting, free of grpc so that the settings (and the
domain cores that read them) need not import the wire layer. tandem.serving.tls turns it into
gRPC and uvicorn credentials."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class TlsConfig(BaseModel):
    """One service's identity as PEM files, and the CA it checks its peers against."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cert: Path  # certificate chain, leaf first
    key: Path  # the leaf's private key, unencrypted
    ca: Path | None = None  # CA certificates a peer's must chain to; None: the system's roots

    @field_validator("cert", "key", "ca")
    @classmethod
    def _readable(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        if path is None:
            return None
        if not path.is_file():
            raise ValueError(f"TLS {info.field_name} file {path} does not exist (or is not a file)")
        if not os.access(path, os.R_OK):
            raise ValueError(f"TLS {info.field_name} file {path} is not readable by this process")
        return path
