"""Imported once by the campaigns' fork server, so that every trial process starts warm."""

import numpy  # noqa: F401
import torch  # noqa: F401

import deltastore  # noqa: F401
import deltastore.cli  # noqa: F401
import deltastore.read.subscriber  # noqa: F401
import deltastore.serving.formats  # noqa: F401
import deltastore.write.publisher  # noqa: F401
from deltastore.storage import _botocore

# Parse the S3 service model once (~0.5 s a client otherwise); forked children share it.
_botocore.botocore_session().create_client(
    "s3", region_name="us-east-1", endpoint_url="http://127.0.0.1:9", aws_access_key_id="x", aws_secret_access_key="x"
)

import campaigns.common  # noqa: E402,F401
import campaigns.model  # noqa: E402,F401
