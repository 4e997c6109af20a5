import { mkdirSync, mkdtempSync, readFileSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { holdsMinioData, propertiesValue, s3proxyServer } from './servers';

describe("s3proxy's spec", () => {
  let dir: string;
  beforeEach(() => (dir = mkdtempSync(join(tmpdir(), 'magus-servers-test-'))));
  afterEach(() => rmSync(dir, { recursive: true, force: true }));

  test('a value reads back through java.util.Properties: backslashes doubled, non-ASCII as \\u escapes', () => {
    expect(propertiesValue('/home/me/.local/share/magus/dev/s3')).toBe('/home/me/.local/share/magus/dev/s3');
    expect(propertiesValue('C:\\data')).toBe('C:\\\\data');
    expect(propertiesValue('/home/zoë/s3')).toBe('/home/zo\\u00eb/s3');
    expect(propertiesValue('a=b:c#d')).toBe('a=b:c#d');
  });

  test('its settings, credentials included, go to a 0600 file; the port is the one thing on its command line', () => {
    const spec = s3proxyServer('/cache/bin/s3proxy.jar', dir, { accessKeyId: 'magusabc', secretAccessKey: 's3cret' });
    const file = join(dir, 's3proxy.properties');
    expect(statSync(file).mode & 0o777).toBe(0o600);
    expect(readFileSync(file, 'utf8').split('\n')).toEqual(
      expect.arrayContaining([
        's3proxy.identity=magusabc',
        's3proxy.credential=s3cret',
        'jclouds.provider=filesystem-nio2',
        `jclouds.filesystem.basedir=${join(dir, 's3')}`,
      ]),
    );
    const args = spec.args({ api: 9123 });
    expect(args).toContain('-Ds3proxy.endpoint=http://127.0.0.1:9123');
    expect(args.slice(-4)).toEqual(['-jar', '/cache/bin/s3proxy.jar', '--properties', file]);
    expect(args.join(' ')).not.toContain('s3cret');
    expect(spec.bin).toBe('java');
  });

  test("a folder whose s3/ MinIO wrote is told apart from s3proxy's", () => {
    s3proxyServer('/cache/bin/s3proxy.jar', dir, { accessKeyId: 'a', secretAccessKey: 'b' });
    expect(holdsMinioData(dir)).toBe(false);
    mkdirSync(join(dir, 's3', '.minio.sys'));
    expect(holdsMinioData(dir)).toBe(true);
  });
});
