"""A static file server for shard directories (`python -m aiohttp.web -H 127.0.0.1 -P PORT
studies.static_server:http_app ROOT`), with Range requests. Its own module, importing only aiohttp,
so a restarted server listens within a fraction of a second: an outage test times the restart."""

from aiohttp import web


def http_app(argv: list[str]) -> web.Application:
    """Serve the directory argv[0]."""
    app = web.Application()
    app.router.add_static("/", argv[0], show_index=True)
    return app
