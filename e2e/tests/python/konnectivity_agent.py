"""An independent konnectivity agent, generated at test time from
proto-crate's .proto files with grpcio-tools (gRPC's C core speaks the
HTTP/2). It calls AgentService.Connect on the proxy-server's agent port over
mTLS with upstream's metadata (agentid, agentidentifiers), prints the
server's answer (`serverid=... servercount=...`, flushed, so the caller knows
the tunnel is up), serves one dial (DIAL_REQ -> TCP connect to 127.0.0.1 and
the dialed port -> DIAL_RSP -> DATA both ways -> CLOSE_RSP once the target
closed), then ends its stream and exits 0 once the server ended its side
with an OK status.

A refused call exits 3 after printing `refused: CODE: details` to stderr.

usage: konnectivity_agent.py GENERATED_DIR SERVER_HOST:PORT CA CERT KEY AGENT_ID IDENTIFIERS
"""

import socket
import sys
import threading

from konnectivity_common import request_stream, secure_channel


def main():
    gen_dir, server, ca, cert, key, agent_id, identifiers = sys.argv[1:8]
    sys.path.insert(0, gen_dir)
    import grpc
    from konnectivity import agent_pb2_grpc
    from konnectivity import client_pb2 as pb

    channel = secure_channel(grpc, server, ca, cert, key)
    stub = agent_pb2_grpc.AgentServiceStub(channel)
    outgoing, requests = request_stream()

    responses = stub.Connect(
        requests,
        metadata=[("agentid", agent_id), ("agentidentifiers", identifiers)],
        timeout=60,
    )
    try:
        answer = dict(responses.initial_metadata())
        print(f"serverid={answer.get('serverid', '')} servercount={answer.get('servercount', '')}", flush=True)
        conn_id = 1
        target = None
        for packet in responses:
            if packet.type == pb.DIAL_REQ:
                port = int(packet.dialRequest.address.rsplit(":", 1)[1])
                target = socket.create_connection(("127.0.0.1", port), timeout=10)
                outgoing.put(pb.Packet(type=pb.DIAL_RSP, dialResponse=pb.DialResponse(random=packet.dialRequest.random, connectID=conn_id)))

                def pump(sock=target):
                    while True:
                        chunk = sock.recv(65536)
                        if not chunk:
                            break
                        outgoing.put(pb.Packet(type=pb.DATA, data=pb.Data(connectID=conn_id, data=chunk)))
                    outgoing.put(pb.Packet(type=pb.CLOSE_RSP, closeResponse=pb.CloseResponse(connectID=conn_id)))
                    # One dial served: end our stream; the server then ends its side.
                    outgoing.put(None)

                threading.Thread(target=pump, daemon=True).start()
            elif packet.type == pb.DATA and target is not None:
                target.sendall(packet.data.data)
            elif packet.type == pb.CLOSE_REQ and target is not None:
                # The client is done: the pump sees the target close and says CLOSE_RSP.
                target.shutdown(socket.SHUT_WR)
    except grpc.RpcError as e:
        sys.stderr.write(f"refused: {e.code().name}: {e.details()}\n")
        sys.exit(3)
    channel.close()


if __name__ == "__main__":
    main()
