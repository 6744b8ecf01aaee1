"""The moto S3 server of the conformance suite, for the backend-specific tests."""

from conformance.s3 import aws_test_credentials, s3_server  # noqa: F401 - fixtures
