// A stdio MCP server in Node.js, as `npx` servers are: what runs on a JIT, and so what a
// sandbox denying writable and executable memory keeps from starting. Newline-delimited
// JSON-RPC on stdin/stdout; one tool, `echo`, read-only.
"use strict";
const readline = require("readline");

const TOOLS = [{
  name: "echo",
  description: "Echo the text back, from Node.js",
  inputSchema: { type: "object", properties: { text: { type: "string" } }, required: ["text"] },
  annotations: { readOnlyHint: true },
}];

function send(message) {
  process.stdout.write(JSON.stringify(message) + "\n");
}

function answer(request) {
  switch (request.method) {
    case "initialize":
      return {
        protocolVersion: request.params.protocolVersion,
        capabilities: { tools: {} },
        serverInfo: { name: "node-echo", version: "1.0.0" },
      };
    case "ping":
      return {};
    case "tools/list":
      return { tools: TOOLS };
    case "tools/call":
      return {
        content: [{ type: "text", text: `node ${process.version} echoes: ${request.params.arguments.text}` }],
        isError: false,
      };
    default:
      return undefined;
  }
}

readline.createInterface({ input: process.stdin }).on("line", (line) => {
  if (!line.trim()) return;
  const request = JSON.parse(line);
  if (request.id === undefined) return; // a notification
  const result = answer(request);
  if (result === undefined) {
    send({ jsonrpc: "2.0", id: request.id, error: { code: -32601, message: `no method ${request.method}` } });
  } else {
    send({ jsonrpc: "2.0", id: request.id, result });
  }
});
