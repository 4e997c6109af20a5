#!/usr/bin/env node
// Removes from a production node_modules the native builds that this platform's magus never
// loads: node-llama-cpp's GPU and other-platform llama.cpp builds (the engine runs the CPU build,
// getLlama({ gpu: false })) and the Temporal core bridge's builds for other platforms. Run by the
// Dockerfile: `node prune-node-modules.js node_modules`; prints what it removed.
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const root = path.resolve(process.argv[2] ?? 'node_modules');
const LLAMA_ARCH = { x64: 'x64', arm64: 'arm64', arm: 'armv7l' }[process.arch];
const RUST_ARCH = { x64: 'x86_64', arm64: 'aarch64' }[process.arch];
if (process.platform !== 'linux' || !LLAMA_ARCH || !RUST_ARCH) throw new Error(`no prebuilt binaries for ${process.platform}-${process.arch}`);

/** Removes every entry of `dir` but `keep`; fails if `keep` is not there (nothing would load). */
function keepOnly(dir, keep) {
  const entries = fs.readdirSync(dir);
  if (!entries.includes(keep)) throw new Error(`${path.join(dir, keep)} is missing`);
  let bytes = 0;
  for (const name of entries) {
    if (name === keep) continue;
    const p = path.join(dir, name);
    bytes += du(p);
    fs.rmSync(p, { recursive: true, force: true });
    console.log(`removed ${path.relative(root, p)}`);
  }
  return bytes;
}

function du(p) {
  const st = fs.lstatSync(p);
  if (!st.isDirectory()) return st.size;
  return fs.readdirSync(p).reduce((sum, name) => sum + du(path.join(p, name)), 0);
}

let freed = 0;
freed += keepOnly(path.join(root, '@node-llama-cpp'), `linux-${LLAMA_ARCH}`);
freed += keepOnly(path.join(root, '@temporalio', 'core-bridge', 'releases'), `${RUST_ARCH}-unknown-linux-gnu`);
console.log(`prune-node-modules: ${(freed / 2 ** 20).toFixed(0)} MiB freed`);
