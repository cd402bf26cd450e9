"""In the sandbox: a URL for harnesses that want one. Listens on the sandbox's own loopback and relays each
connection to the episode's recording proxy, the Unix socket mounted from the host. The sandbox has no network, so
no IP traffic leaves the container. Started by start.sh, as the policy's user; stdlib only.

    python3 forward.py SOCKET PORT
"""

import asyncio
import sys


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        try:
            writer.close()
        except Exception:  # noqa: BLE001
            pass


async def main(socket_path: str, port: int) -> None:
    async def relay(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            proxy_r, proxy_w = await asyncio.open_unix_connection(socket_path)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, proxy_w), pipe(proxy_r, client_w))

    server = await asyncio.start_server(relay, "127.0.0.1", port)
    print(f"forwarding 127.0.0.1:{port} -> {socket_path}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2])))
