"""An independent konnectivity gRPC client, generated at test time from
proto-crate's .proto files with grpcio-tools. It speaks to the proxy-server's
client port over mTLS: DIAL_REQ -> DIAL_RSP -> DATA (an HTTP GET) -> DATA* ->
CLOSE_REQ -> CLOSE_RSP, and prints the HTTP response it received.

usage: konnectivity_client.py GENERATED_DIR SERVER_HOST:PORT CA CERT KEY DIAL_ADDRESS
"""

import random
import sys

from konnectivity_common import request_stream, secure_channel


def main():
    gen_dir, server, ca, cert, key, address = sys.argv[1:7]
    sys.path.insert(0, gen_dir)
    import grpc
    from konnectivity import client_pb2 as pb
    from konnectivity import client_pb2_grpc as pb_grpc

    channel = secure_channel(grpc, server, ca, cert, key)
    stub = pb_grpc.ProxyServiceStub(channel)
    outgoing, requests = request_stream()

    dial_id = random.getrandbits(62) + 1
    outgoing.put(pb.Packet(type=pb.DIAL_REQ, dialRequest=pb.DialRequest(protocol="tcp", address=address, random=dial_id)))
    responses = stub.Proxy(requests, timeout=30)

    first = next(responses)
    if first.type != pb.DIAL_RSP or first.dialResponse.random != dial_id:
        sys.exit(f"unexpected first packet: {first}")
    if first.dialResponse.error:
        sys.exit(f"dial failed: {first.dialResponse.error}")
    conn_id = first.dialResponse.connectID

    request = f"GET / HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n".encode()
    outgoing.put(pb.Packet(type=pb.DATA, data=pb.Data(connectID=conn_id, data=request)))

    body = b""
    for packet in responses:
        if packet.type == pb.DATA and packet.data.connectID == conn_id:
            body += packet.data.data
        elif packet.type == pb.CLOSE_RSP:
            break
    # The target closes after its response; we still say goodbye the protocol's way.
    outgoing.put(pb.Packet(type=pb.CLOSE_REQ, closeRequest=pb.CloseRequest(connectID=conn_id)))
    outgoing.put(None)
    channel.close()
    sys.stdout.write(body.decode("utf-8", "replace"))


if __name__ == "__main__":
    main()
