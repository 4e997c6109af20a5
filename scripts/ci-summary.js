#!/usr/bin/env node
// Prints "N passed, N failed" from jest's JSON results. A failure before jest ran (build, server
// install, lint, typecheck) or a suite that could not run counts as one failed check, so a red
// run never reads "0 failed".
'use strict';
const fs = require('node:fs');
const [file, rcArg] = process.argv.slice(2);
const rc = Number(rcArg ?? 0);
let passed = 0;
let failed = 0;
if (file && fs.existsSync(file)) {
  const r = JSON.parse(fs.readFileSync(file, 'utf8'));
  passed = r.numPassedTests;
  failed = r.numFailedTests + r.numRuntimeErrorTestSuites;
}
if (rc !== 0 && failed === 0) failed = 1;
console.log(`${passed} passed, ${failed} failed`);
