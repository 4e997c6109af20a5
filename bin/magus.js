#!/usr/bin/env node
// The CLI runs from the JavaScript that `npm ci` builds in `prepare` (tsc → dist/).
'use strict';
const path = require('node:path');
const fs = require('node:fs');
// V8's compiled code is kept on disk (the OS's temporary folder, keyed by Node's version) and
// reused by the next start: a replica or a bridge started again parses and compiles less — a
// gateway started beside one taking a killed replica's clients costs it ~0.1 s less CPU
// (bench/README.md, "A replica's start"). Node before 22.1 has no such cache: nothing is done.
require('node:module').enableCompileCache?.();
// `magus --version` needs nothing built: the version is the package's.
if (process.argv[2] === '--version' && process.argv.length === 3) {
  console.log(require(path.join(__dirname, '..', 'package.json')).version);
  process.exit(0);
}
const entry = path.join(__dirname, '..', 'dist', 'workers', 'magus.js');
if (!fs.existsSync(entry)) {
  console.error('magus: dist/ is missing; run `npm ci` (or `npm run build`) in the checkout first.');
  process.exit(1);
}
require(entry)
  .main(process.argv.slice(2))
  .then(
    (code) => process.exit(code),
    (err) => {
      console.error(`magus: ${err instanceof Error ? err.message : String(err)}`);
      process.exit(1);
    },
  );
