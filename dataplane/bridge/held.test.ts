import { dueOf } from './held';

const bytes = (s: string) => new TextEncoder().encode(s);

describe('dueOf: the deadline a held request is ordered by', () => {
  it("is the request's deadline", () => {
    expect(dueOf(bytes(JSON.stringify({ id: 'r', deadline: 1_796_550_000_000 })))).toBe(1_796_550_000_000);
  });

  it('is -Infinity for a request that says none, or none that is a finite number, or is not JSON: it goes first, to be refused at once', () => {
    for (const data of ['{"id":"r"}', '{"deadline":"soon"}', '{"deadline":null}', 'null', '[1', '']) expect(dueOf(bytes(data))).toBe(-Infinity);
  });
});
