"""Generated gRPC stubs for the gateway contract (proto/*.proto).

Regenerate with `python scripts/gen_proto.py`; tests/test_proto_contract.py
checks them against smg-grpc-proto's published definitions.
"""
