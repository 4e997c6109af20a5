#!/usr/bin/env node
// Prints "N passed, N failed, N skipped, N todo" from jest's JSON results, and exits 1 when the
// run is red. A failure before jest ran (build, server install, lint, typecheck) or a suite that
// could not run counts as one failed check, so a red run never reads "0 failed".
// A skipped test (test.skip, describe.skip, a skip on a condition) turns the run red unless
// test/skips.json lists it with the reason: { "<test file>": { "<full test name>": "why" } }, the
// file relative to the repository, the name as jest reports it (describe titles, then the test's).
// Usage: ci-summary.js <jest.json> <exit code of the test command> [<allow-list>]
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const root = path.join(__dirname, '..');
const [file, rcArg, allowArg] = process.argv.slice(2);
const rc = Number(rcArg ?? 0);
const allowFile = allowArg ?? path.join(root, 'test', 'skips.json');
const allowed = fs.existsSync(allowFile) ? JSON.parse(fs.readFileSync(allowFile, 'utf8')) : {};

let passed = 0;
let failed = 0;
let skipped = 0;
let todo = 0;
const unlisted = [];
if (file && fs.existsSync(file)) {
  const r = JSON.parse(fs.readFileSync(file, 'utf8'));
  passed = r.numPassedTests;
  failed = r.numFailedTests + r.numRuntimeErrorTestSuites;
  skipped = r.numPendingTests;
  todo = r.numTodoTests;
  for (const suite of r.testResults) {
    const rel = path.relative(root, suite.name).split(path.sep).join('/');
    for (const t of suite.assertionResults) {
      if ((t.status === 'pending' || t.status === 'skipped' || t.status === 'disabled') && !allowed[rel]?.[t.fullName]) unlisted.push(`${rel}: ${t.fullName}`);
    }
  }
}
for (const u of unlisted) console.error(`skipped, and not in ${path.relative(root, allowFile)}: ${u}`);
const red = rc !== 0 || unlisted.length > 0;
if (red && failed === 0) failed = 1;
console.log(`${passed} passed, ${failed} failed, ${skipped} skipped, ${todo} todo`);
process.exitCode = red ? 1 : 0;
