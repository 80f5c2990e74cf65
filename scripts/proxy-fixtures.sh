#!/usr/bin/env bash
# Installs the MCP servers tests/doors/proxy.rs puts `mcp-ratelimit proxy` in front of, from the
# package registries, once: the official `@modelcontextprotocol/server-everything` (npm, into
# .tools/node) and FastMCP (PyPI, into a virtualenv at .tools/python) for the tests' own small
# Python server (tests/fixtures/fastmcp_server.py); and the authorization server the OAuth tests
# get tokens from, `oauth2-mock-server` (npm; tests/fixtures/oauth_provider.mjs wraps it). Later
# runs find them and install nothing.
#
#   scripts/proxy-fixtures.sh
set -euo pipefail
cd "$(dirname "$0")/.."

EVERYTHING_VERSION="2026.8.31"
FASTMCP_VERSION="4.2.3"
OAUTH2_MOCK_SERVER_VERSION="9.3.0"

. scripts/lib.sh
ensure_npm_tool "@modelcontextprotocol/server-everything@$EVERYTHING_VERSION" mcp-server-everything
ensure_npm_tool "oauth2-mock-server@$OAUTH2_MOCK_SERVER_VERSION" oauth2-mock-server

venv=".tools/python"
if ! "$venv/bin/python" -c "import fastmcp, sys; sys.exit(fastmcp.__version__ != '$FASTMCP_VERSION')" 2>/dev/null; then
  echo "installing fastmcp $FASTMCP_VERSION into $venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "fastmcp==$FASTMCP_VERSION"
fi
