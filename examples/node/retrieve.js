// One grace.v1.AdRetrieval/Retrieve from Node.js (@grpc/grpc-js, @grpc/proto-loader): a
// health check, the call, its ads, and on an error the google.rpc.Status details of the
// `grpc-status-details-bin` trailer. The server's request id comes from the `x-request-id`
// trailer, on errors too. Commands and pitfalls: docs/CLIENTS.md "From Node.js".
//
//   node retrieve.js [--target localhost:50051] [--timeout 1] [request.json]
//
// request.json: one RetrieveRequest in protobuf JSON, or a JSON Lines file of them (the
// request log, `grace record`: its first line); without it, a request built below.
'use strict';

const fs = require('node:fs');
const path = require('node:path');
const { parseArgs } = require('node:util');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

const defs = protoLoader.loadSync(
  [
    'grace/v1/retrieval.proto', // the repository's proto/
    'grpc/health/v1/health.proto', // vendored here: proto/ beside this file
    'google/rpc/status.proto',
    'google/rpc/error_details.proto',
  ],
  {
    keepCase: false, // camelCase names, as in protobuf JSON (keepCase: true drops them all)
    longs: String, // int64 ids and timestamps as decimal strings: a JS number loses digits
    enums: String, // enum values by name ("CD_GTM")
    defaults: true, // every field present in what is decoded
    includeDirs: [path.join(__dirname, '..', '..', 'proto'), path.join(__dirname, 'proto')],
  },
);
const pkg = grpc.loadPackageDefinition(defs);

// A unary call's reply (null on an error) and final status (code, details, trailers).
function unary(client, method, message, timeout) {
  return new Promise((resolve) => {
    let reply = null;
    const deadline = new Date(Date.now() + timeout * 1000); // always send a deadline
    const call = client[method](message, { deadline }, (_error, r) => (reply = r ?? null));
    call.on('status', (status) => resolve({ reply, status }));
  });
}

function readRequest(file) {
  const text = fs.readFileSync(file, 'utf8').trim();
  try {
    return JSON.parse(text);
  } catch {
    return JSON.parse(text.split('\n')[0]); // JSON Lines: the first request
  }
}

// Names of `sent` that a serialise/parse round trip lost: protobufjs drops unknown fields
// without a word (a snake_case `user_id` here, a typo), and the server would then answer
// another request than the one meant.
function droppedFields(sent, kept, at = '') {
  return Object.entries(sent).flatMap(([key, value]) => {
    if (!(key in kept)) return [at + key];
    const nested = value && typeof value === 'object'; // messages, and lists (by index)
    return nested ? droppedFields(value, kept[key], `${at}${key}.`) : [];
  });
}

function printError(status) {
  console.log(`${grpc.status[status.code]}: ${status.details}`);
  const [raw] = status.metadata.get('grpc-status-details-bin');
  if (!raw) return;
  // (protobufjs's own google.protobuf types keep proto names: Any's `type_url` whatever keepCase)
  for (const { type_url: url, value } of defs['google.rpc.Status'].deserialize(raw).details) {
    const type = url.split('/').pop(); // type.googleapis.com/google.rpc.BadRequest
    if (type === 'google.rpc.BadRequest') {
      for (const v of defs[type].deserialize(value).fieldViolations) {
        console.log(`  bad field ${v.field}: ${v.description}`);
      }
    } else if (type === 'google.rpc.RetryInfo') {
      const delay = defs[type].deserialize(value).retryDelay;
      console.log(`  retry after ${Number(delay.seconds) + delay.nanos / 1e9} s`);
    }
  }
}

async function main() {
  const { values, positionals } = parseArgs({
    options: {
      target: { type: 'string', default: 'localhost:50051' },
      timeout: { type: 'string', default: '1' }, // seconds
    },
    allowPositionals: true,
  });
  const timeout = Number(values.timeout);
  const request = positionals[0]
    ? readRequest(positionals[0])
    : {
        user: {
          userId: '7', // int64 as a string, as protobuf JSON writes it
          history: [{ adId: '101', type: 'CLICK', timestampMs: '1764590000000' }],
        },
        targeting: { country: 'US', age: 31 },
        options: { maxAds: 5, filterMode: 'CD_GTM' },
      };
  const Request = defs['grace.v1.RetrieveRequest'];
  const dropped = droppedFields(request, Request.deserialize(Request.serialize(request)));
  if (dropped.length) {
    const names = dropped.join(', ');
    console.error(`not RetrieveRequest fields (camelCase names, keepCase: false): ${names}`);
    return 2;
  }

  const credentials = grpc.credentials.createInsecure();
  const health = new pkg.grpc.health.v1.Health(values.target, credentials);
  const client = new pkg.grace.v1.AdRetrieval(values.target, credentials);
  try {
    const probe = await unary(health, 'Check', { service: 'grace.v1.AdRetrieval' }, timeout);
    if (probe.reply === null) {
      printError(probe.status);
      return 1;
    }
    console.log(`health: ${probe.reply.status}`);

    const { reply, status } = await unary(client, 'Retrieve', request, timeout);
    if (reply === null) printError(status);
    // the server's id of the call, as on its log lines (percent-encoded beyond printable ASCII)
    const [requestId] = status.metadata.get('x-request-id');
    if (requestId) console.log(`request id: ${requestId}`);
    if (reply === null) return 1;
    console.log(`index ${reply.indexVersion} model ${reply.modelVersion}: ${reply.ads.length} ads`);
    for (const [i, ad] of reply.ads.entries()) {
      console.log(`${i + 1}\tad ${ad.adId}\tscore ${ad.score.toFixed(3)}`);
    }
    return 0;
  } finally {
    health.close();
    client.close();
  }
}

main().then(
  (code) => (process.exitCode = code),
  (error) => {
    console.error(error.message); // an unreadable request file, a bad option
    process.exitCode = 2;
  },
);
