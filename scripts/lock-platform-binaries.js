#!/usr/bin/env node
// The package registry reachable from our build machines lacks some other-platform builds of
// native packages (e.g. @swc/core-darwin-arm64), so `npm install` leaves them out of
// package-lock.json and `npm ci` then rejects the lock as out of sync. This adds a lock entry
// for every optional platform package a locked package names but the lock lacks, marked with the
// os/cpu/libc its name encodes: npm skips it on other platforms and fetches it by version on its
// own. Run after `npm install` changes the lock: `node scripts/lock-platform-binaries.js`.
'use strict';
const fs = require('node:fs');
const path = require('node:path');

const lockPath = path.join(__dirname, '..', 'package-lock.json');
const lock = JSON.parse(fs.readFileSync(lockPath, 'utf8'));
const OS = {
  darwin: 'darwin',
  mac: 'darwin',
  linux: 'linux',
  win32: 'win32',
  win: 'win32',
  android: 'android',
  freebsd: 'freebsd',
  openharmony: 'openharmony',
  sunos: 'sunos',
  aix: 'aix',
};
const CPU = { arm64: 'arm64', x64: 'x64', ia32: 'ia32', arm: 'arm', ppc64: 'ppc64', s390x: 's390x', riscv64: 'riscv64', loong64: 'loong64' };

function platformOf(name) {
  const parts = name.split('/').pop().split('-');
  const os = parts.map((p) => OS[p]).find(Boolean);
  const cpu = parts.map((p) => CPU[p]).find(Boolean);
  if (!os || !cpu) return undefined;
  const entry = { os: [os], cpu: [cpu] };
  if (os === 'linux') {
    if (parts.some((p) => p.startsWith('musl'))) entry.libc = ['musl'];
    else if (parts.some((p) => p.startsWith('gnu'))) entry.libc = ['glibc'];
  }
  return entry;
}

let added = 0;
for (const [key, pkg] of Object.entries(lock.packages)) {
  for (const [name, version] of Object.entries(pkg.optionalDependencies ?? {})) {
    const target = `node_modules/${name}`;
    const nested = `${key}/node_modules/${name}`;
    if (lock.packages[target] || lock.packages[nested]) continue;
    const platform = platformOf(name);
    if (!platform) continue;
    lock.packages[target] = { version, dev: pkg.dev, optional: true, ...platform };
    if (!pkg.dev) delete lock.packages[target].dev;
    added++;
  }
}
lock.packages = Object.fromEntries(Object.entries(lock.packages).sort(([a], [b]) => (a === '' ? -1 : b === '' ? 1 : a.localeCompare(b))));
fs.writeFileSync(lockPath, `${JSON.stringify(lock, null, 2)}\n`);
console.log(`lock-platform-binaries: added ${added} platform entries`);
