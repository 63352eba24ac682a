"""What the independent konnectivity client and agent share: an mTLS gRPC
channel to the proxy-server and a request stream fed from a queue."""

import queue


def secure_channel(grpc, server, ca, cert, key):
    """A channel to SERVER (host:port) presenting CERT/KEY and trusting CA,
    verifying the server's certificate for `localhost`."""
    with open(ca, "rb") as f:
        ca_pem = f.read()
    with open(cert, "rb") as f:
        cert_pem = f.read()
    with open(key, "rb") as f:
        key_pem = f.read()
    creds = grpc.ssl_channel_credentials(ca_pem, key_pem, cert_pem)
    return grpc.secure_channel(server, creds, options=[("grpc.ssl_target_name_override", "localhost")])


def request_stream():
    """A queue and the request iterator it feeds; putting None ends the stream."""
    outgoing = queue.Queue()

    def requests():
        while True:
            item = outgoing.get()
            if item is None:
                return
            yield item

    return outgoing, requests()
