import { prng, validator } from '../../test/fixtures/grammar-schemas';
import { matches, parseGbnf, sample } from './gbnf-match';
import { FORMATS } from './formats';
import { schemaToGbnf } from './index';

const ajv = validator();
const grammarOf = (format: string) => {
  const r = schemaToGbnf({ type: 'string', format });
  if (!r.ok) throw new Error(r.message);
  return parseGbnf(r.gbnf);
};
const ajvAccepts = (format: string) => {
  const validate = ajv.compile({ type: 'string', format });
  return (s: string) => validate(s);
};
const pick = <T>(random: () => number, xs: readonly T[]): T => xs[Math.floor(random() * xs.length)]!;

describe('formats: only strings ajv-formats accepts, and all of them within the stated bounds', () => {
  test.each(FORMATS.map((f) => [f]))('%s: 300 samples validate', (format) => {
    const g = grammarOf(format);
    const ok = ajvAccepts(format);
    const random = prng(format.length * 7);
    for (let i = 0; i < 300; i++) {
      const text = sample(g, random);
      expect([text, ok(JSON.parse(text) as string)]).toEqual([text, true]);
    }
  });

  test('date: every year kind × month 00–13 × day 00–32, as ajv-formats says', () => {
    const g = grammarOf('date');
    const ok = ajvAccepts('date');
    for (const year of ['0000', '1900', '1996', '2000', '2023', '2024', '2100', '2400', '9999'])
      for (let month = 0; month <= 13; month++)
        for (let day = 0; day <= 32; day++) {
          const s = `${year}-${String(month).padStart(2, '0')}-${String(day).padStart(2, '0')}`;
          expect([s, matches(g, JSON.stringify(s))]).toEqual([s, ok(s)]);
        }
  });

  test('time and date-time: within RFC 3339 exactly ajv-formats; its laxer forms (+hhmm, +hh, :60, a space) left out', () => {
    const time = grammarOf('time');
    const dateTime = grammarOf('date-time');
    const okTime = ajvAccepts('time');
    const okDateTime = ajvAccepts('date-time');
    const rfc = /^\d\d:\d\d:\d\d(\.\d{1,9})?([Zz]|[+-]\d\d:\d\d)$/;
    for (const hh of ['00', '09', '23', '24'])
      for (const mm of ['00', '59', '60'])
        for (const ss of ['00', '59', '60'])
          for (const frac of ['', '.5', '.123456789', '.1234567890'])
            for (const tz of ['Z', 'z', '+05:30', '-23:59', '+24:00', '+05:60', '+0530', '+05', '']) {
              const s = `${hh}:${mm}:${ss}${frac}${tz}`;
              const inRfc = rfc.test(s) && ss !== '60';
              expect([s, matches(time, JSON.stringify(s))]).toEqual([s, inRfc && okTime(s)]);
              for (const sep of ['T', 't', ' ']) {
                const dt = `2024-02-29${sep}${s}`;
                expect([dt, matches(dateTime, JSON.stringify(dt))]).toEqual([dt, inRfc && sep !== ' ' && okDateTime(dt)]);
              }
            }
  });

  test('ipv4 and uuid: exactly ajv-formats (uuid without its urn: prefix)', () => {
    const ipv4 = grammarOf('ipv4');
    const uuid = grammarOf('uuid');
    const okIpv4 = ajvAccepts('ipv4');
    const okUuid = ajvAccepts('uuid');
    const random = prng(4);
    const octets = ['0', '00', '01', '1', '9', '10', '99', '100', '199', '200', '249', '250', '255', '256', '300', '1000', ''];
    for (let i = 0; i < 3000; i++) {
      const n = pick(random, [3, 4, 4, 4, 5]);
      const s = Array.from({ length: n }, () => pick(random, octets)).join('.');
      expect([s, matches(ipv4, JSON.stringify(s))]).toEqual([s, okIpv4(s)]);
    }
    const hex = '0123456789abcdefABCDEFg-';
    for (let i = 0; i < 2000; i++) {
      const s = [8, 4, 4, 4, 12]
        .map((len) => Array.from({ length: len + (random() < 0.05 ? 1 : 0) }, () => pick(random, [...hex.slice(0, random() < 0.9 ? 22 : 24)])).join(''))
        .join(random() < 0.95 ? '-' : '');
      expect([s, matches(uuid, JSON.stringify(s))]).toEqual([s, okUuid(s)]);
    }
  });

  test('ipv6: exactly ajv-formats on random group sequences', () => {
    const g = grammarOf('ipv6');
    const ok = ajvAccepts('ipv6');
    const random = prng(6);
    const groups = ['0', '1', 'ab', 'FFFF', '0dEa', '12a', ...(random() < 0.5 ? ['fffff', 'g'] : [])];
    let valid = 0;
    for (let i = 0; i < 4000; i++) {
      // 1–9 groups, some separators doubled (`::`), sometimes an IPv4 tail or a leading/trailing `::`.
      const n = 1 + Math.floor(random() * 9);
      let s = Array.from({ length: n }, () => pick(random, groups)).reduce((acc, grp) => `${acc}${random() < 0.15 ? '::' : ':'}${grp}`);
      if (random() < 0.2) s = `${s}:${pick(random, ['1.2.3.4', '255.255.255.255', '256.1.1.1', '01.2.3.4'])}`;
      if (random() < 0.1) s = `::${s}`;
      if (random() < 0.1) s = `${s}::`;
      const want = ok(s);
      if (want) valid++;
      expect([s, matches(g, JSON.stringify(s))]).toEqual([s, want]);
    }
    expect(valid).toBeGreaterThan(200);
  });

  test('duration: exactly ajv-formats, numbers of up to 9 digits', () => {
    const g = grammarOf('duration');
    const ok = ajvAccepts('duration');
    const random = prng(7);
    const parts = ['1Y', '2M', '3D', 'T', '4H', '5M', '6S', '7W', '12D', '1.5S', ''];
    for (let i = 0; i < 4000; i++) {
      const s = `P${Array.from({ length: Math.floor(random() * 5) }, () => pick(random, parts)).join('')}`;
      expect([s, matches(g, JSON.stringify(s))]).toEqual([s, ok(s)]);
    }
    expect(matches(g, JSON.stringify('P1234567890D'))).toBe(false);
    expect(ok('P1234567890D')).toBe(true);
  });

  test('hostname and email: what the grammar admits ajv-formats accepts; what fits its bounds it admits', () => {
    const host = grammarOf('hostname');
    const email = grammarOf('email');
    const okHost = ajvAccepts('hostname');
    const okEmail = ajvAccepts('email');
    const random = prng(8);
    const labelChars = 'ab0-Z_.';
    const label = () => Array.from({ length: 1 + Math.floor(random() * 4) }, () => pick(random, [...labelChars])).join('');
    for (let i = 0; i < 3000; i++) {
      const h = Array.from({ length: 1 + Math.floor(random() * 4) }, label).join(pick(random, ['.', '.', '..']));
      // Within the grammar's bounds (at most 8 labels of at most 30 characters), the same verdict.
      expect([h, matches(host, JSON.stringify(h))]).toEqual([h, okHost(h)]);
      const e = `${label()}${pick(random, ['@', '@', '.'])}${h}`;
      expect([e, matches(email, JSON.stringify(e))]).toEqual([e, okEmail(e)]);
    }
    // Beyond the bounds: never more than ajv-formats.
    const long = `${'a'.repeat(63)}.${'b'.repeat(63)}.${'c'.repeat(63)}.${'d'.repeat(61)}`;
    expect(okHost(long)).toBe(true);
    expect(matches(host, JSON.stringify(long))).toBe(false); // 4 labels: at most 62 each
    expect(matches(host, JSON.stringify(`${'a'.repeat(62)}.${'b'.repeat(62)}.${'c'.repeat(62)}.${'d'.repeat(62)}`))).toBe(true);
    expect(matches(host, JSON.stringify(`${'a'.repeat(63)}.${'b'.repeat(63)}.${'c'.repeat(63)}`))).toBe(true);
  });
});
